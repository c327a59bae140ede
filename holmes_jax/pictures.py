"""Pictures of a Plan (`python -m holmes_jax.plan --draw FILE.png`): (a) one predicted step as a
timeline per stage, the cost model's tick walk drawn out, and (b) the placement: clusters, nodes,
each device's stage and data replica, the NIC class each stage's data groups sync over, and the
links the stage boundaries cross. matplotlib stays out of the JAX-free planning package; the plan
command gets `draw_plan` passed in."""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter

import matplotlib
import numpy as np
from matplotlib import transforms
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle
from matplotlib.textpath import TextPath, TextToPath
from matplotlib.ticker import FuncFormatter, MaxNLocator

from holmes_jax.config import ConfigError
from holmes_jax.planning import schedule as schedules
from holmes_jax.planning.contract import Plan, format_seconds

NIC_COLOURS = {"infiniband": "#1f5fa8", "roce": "#d9700f", "ethernet": "#6b6b6b"}
KIND_COLOURS = {"forward": "#9ad48a", "backward": "#2f7d4f", "transfer": "#9467bd", "sync": "#d62728",
                "update": "#e8c12c", "fixed": "#8c8c8c"}
KIND_LABELS = {"forward": "forward", "backward": "backward (the last stage: with its forward)",
               "transfer": "activations / gradients between stages", "sync": "sync: gradients, ZeRO-1's update gather",
               "update": "optimizer step", "fixed": "fixed per-step work (fitted)"}
STAGE_COLOURS = matplotlib.colormaps["Pastel1"].colors + matplotlib.colormaps["Pastel2"].colors


def _figure(**size) -> Figure:
    """A figure on the Agg canvas: files only, no pyplot state and no display needed."""
    fig = Figure(**size)
    FigureCanvasAgg(fig)
    return fig


def _as_typed(draw):
    """`draw` with its text drawn as typed: a '$' in a cluster's name or a path is no mathtext."""
    @functools.wraps(draw)
    def plain(*args, **kwargs):
        with matplotlib.rc_context({"text.parse_math": False}):
            return draw(*args, **kwargs)

    return plain


def _save(fig: Figure, path: str) -> None:
    try:
        fig.savefig(path, bbox_inches="tight")
    except OSError as e:  # the output side (a folder gone, a directory of that name, a full disk)
        raise ConfigError(f"the picture {path!r} cannot be written: {e.strerror or e}") from None


@dataclasses.dataclass(frozen=True)
class Segment:
    stage: int
    start: float
    seconds: float
    kind: str  # a key of KIND_COLOURS
    microbatch: int = -1


def timeline(plan: Plan) -> list[Segment]:
    """The step as the cost model walks it (holmes_jax.planning.cost.simulate): each stage
    gathers the last step's updates (ZeRO-1, drawn as sync); then tick by tick each stage runs its
    forward (the last stage runs it inside its backward's tick), then its backward; the tick
    lasts as long as its slowest stage, then activations and gradients cross the slowest boundary
    where any stage sends them; once a stage leaves the ticks it reduces its gradients, waits
    for the slowest stage's reduction (idle: the sum over `stage` and the global norm need them
    all), sums the embedding's and head's gradients over `stage` (drawn as sync, like the
    reduction), updates its parameters and pays its fixed part."""
    pr, p = plan.prediction, plan.pp
    fwd, bwd = schedules.ticks(plan.schedule, p, plan.microbatches)
    moves = schedules.hops_per_tick(fwd, bwd)
    hop = max(pr.p2p_s, default=0.0)
    segments, now = [Segment(s, 0.0, pr.stage_gather_s[s], "sync") for s in range(p) if pr.stage_gather_s[s]], 0.0
    for tick in range(fwd.shape[0]):
        longest = 0.0
        for s in range(p):
            at = max(now, pr.stage_gather_s[s])
            if fwd[tick, s] >= 0 and s < p - 1:
                segments.append(Segment(s, at, pr.stage_fwd_s[s], "forward", int(fwd[tick, s])))
                at += pr.stage_fwd_s[s]
            if bwd[tick, s] >= 0:  # the last stage runs the microbatch's forward in the same tick
                seconds = pr.stage_bwd_s[s] + (pr.stage_fwd_s[s] if s == p - 1 else 0.0)
                segments.append(Segment(s, at, seconds, "backward", int(bwd[tick, s])))
                at += seconds
            longest = max(longest, at - now)
        now += longest
        if moves[tick] and hop:
            segments += [Segment(s, now, moves[tick] * hop, "transfer") for s in range(p)]
            now += moves[tick] * hop
    for s in range(p):  # its reduction; the wait for the slowest one stays idle; the sum over stage
        update, fixed = pr.stage_update_s[s], pr.stage_fixed_s[s]
        segments.append(Segment(s, pr.stage_busy_s[s], pr.stage_sync_s[s] - pr.stage_gather_s[s], "sync"))
        summed = pr.stage_finish_s[s] - update - fixed
        segments.append(Segment(s, summed - pr.shared_sum_s, pr.shared_sum_s, "sync"))
        segments.append(Segment(s, summed, update, "update"))
        segments.append(Segment(s, summed + update, fixed, "fixed"))
    return segments


@_as_typed
def draw_plan(plan: Plan, path: str) -> None:
    """Writes the timeline (top) and the placement (bottom) of `plan` to `path` (format from its suffix)."""
    width, height = _placement_extent(plan)
    # (b) keeps its aspect, at least ~12.4 in wide; wider placements widen the figure, so that a
    # device width stays UNIT_IN and the labels keep their room (fixed font sizes)
    scale = max(1.0, width * UNIT_IN / 12.4)
    timeline_in, placement_in = 0.75 * plan.pp, 14.5 * height / width * scale
    fig = _figure(figsize=(16 * scale, timeline_in + placement_in + 2.2), dpi=110)
    grid = fig.add_gridspec(2, 1, height_ratios=[timeline_in, placement_in],
                            hspace=2.6 / (timeline_in + placement_in))  # ~1.3 in for the axis label and legend
    _draw_timeline(fig.add_subplot(grid[0]), plan)
    _draw_placement(fig.add_subplot(grid[1]), plan)
    _save(fig, path)


def _layers(n: int) -> str:
    return f"{n} layer{'s' * (n != 1)}"


def time_unit(seconds: float) -> tuple[float, str]:
    """(scale, unit) to show times near `seconds`: s from a second up, else ms (not '1.085e+04 ms')."""
    return (1.0, "s") if seconds >= 1 else (1e3, "ms")


def _label_px(microbatch: int, dpi: float) -> float:
    """The width a microbatch number takes as drawn (fontsize 7), in pixels."""
    width_pt, _, _ = TextToPath().get_text_width_height_descent(str(microbatch), FontProperties(size=7), False)
    return width_pt * dpi / 72


def _draw_timeline(ax, plan: Plan) -> None:
    pr, m = plan.prediction, plan.model
    segments = timeline(plan)
    step = pr.step_time_s
    shown_s = step * 1.01  # the x axis' span
    px_per_s = ax.get_position().width * ax.figure.get_figwidth() * ax.figure.dpi / shown_s
    for s in range(plan.pp):
        y = plan.pp - 1 - s  # stage 0 on top
        ax.add_patch(Rectangle((0, y - 0.4), step, 0.8, facecolor="#f4f4f4", edgecolor="#c8c8c8", hatch="////",
                               linewidth=0, zorder=0))
        for kind, colour in KIND_COLOURS.items():
            bars = [(g.start, g.seconds) for g in segments if g.stage == s and g.kind == kind and g.seconds > 0]
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=colour, edgecolors="white",
                           linewidth=0.3 if len(segments) < 60 * plan.pp else 0, zorder=1)
        for g in segments:  # microbatch numbers where the box holds them with a margin (not touching the next one)
            if g.stage == s and g.microbatch >= 0 and g.seconds * px_per_s > _label_px(g.microbatch, ax.figure.dpi) + 4:
                ax.text(g.start + g.seconds / 2, y, str(g.microbatch), ha="center", va="center", fontsize=7,
                        color="white" if g.kind == "backward" else "black", zorder=2)
    ax.set_yticks(range(plan.pp))
    ax.set_yticklabels([f"stage {s}: {plan.placement.stage_clusters[s]}\n{_layers(plan.stage_layers[s])}"
                        for s in reversed(range(plan.pp))])
    ax.set_ylim(-0.6, plan.pp - 0.4)
    ax.set_xlim(0, shown_s)
    ax.axvline(pr.pipeline_s, color="black", linewidth=0.8, linestyle=":")
    ax.axvline(step, color="black", linewidth=1.2, linestyle="--")
    if step - pr.pipeline_s > 0.15 * step:
        ax.text(pr.pipeline_s, plan.pp - 0.4, f"pipeline ends {format_seconds(pr.pipeline_s)} ", ha="right",
                va="bottom", fontsize=9)
        ax.text(step, plan.pp - 0.4, f"step {format_seconds(step)}", ha="right", va="bottom", fontsize=9)
    else:  # too close for two labels
        ax.text(step, plan.pp - 0.4, f"pipeline ends {format_seconds(pr.pipeline_s)}, "
                f"step {format_seconds(step)}", ha="right", va="bottom", fontsize=9)
    scale, unit = time_unit(step)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x * scale:g}"))
    ax.set_xlabel(f"time in the step ({unit}), as the cost model predicts it")
    microbatches = f"{plan.microbatches} microbatch{'es' * (plan.microbatches > 1)} of {plan.micro_batch}"
    remat = f", remat {m.remat}" if m.remat != "none" else ""  # a longer backward: it recomputes
    ax.set_title(f"(a) one step of {m.preset} ({m.num_layers} layers, {m.compute_dtype}{remat}) on "
                 f"'{plan.topology.name}': {plan.schedule}, {microbatches}, "
                 f"mesh stage={plan.pp} data={plan.dp} tensor={plan.tp}", loc="left", fontsize=11, pad=16)
    shown = {g.kind for g in segments if g.seconds > 0}
    handles = [Patch(facecolor=c, label=KIND_LABELS[k]) for k, c in KIND_COLOURS.items() if k in shown]
    handles.append(Patch(facecolor="#f4f4f4", hatch="////", edgecolor="#c8c8c8", label="idle"))
    below = transforms.offset_copy(ax.transAxes, ax.figure, y=-36, units="points")  # under the axis label
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0, 0), bbox_transform=below, ncol=6, fontsize=8,
              frameon=False)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


GAP = 7.0  # between clusters, in device widths: room for a link's label
NOTES_TOP = -1.9  # where the notes under the clusters start
UNIT_IN = 12.4 / 30.6  # inches a device width takes in the placement drawing


def _cluster_title(c) -> str:
    return (f"{c.name}: {c.nic}, {c.nic_link.gbps:g} Gb/s per node\n"
            f"{c.nodes} node{'s' * (c.nodes > 1)} x {c.devices_per_node} device{'s' * (c.devices_per_node > 1)}")


def _cluster_width(c) -> float:
    """A cluster's frame width in device widths: its devices', or its title's where that is wider."""
    title_pt = max(TextPath((0, 0), line, size=9, prop=FontProperties(weight="bold")).get_extents().width
                   for line in _cluster_title(c).split("\n"))
    return max(c.devices_per_node + 2.2, title_pt / 72 / UNIT_IN + 0.5)


def _placement_extent(plan: Plan) -> tuple[float, float]:
    """(width, height) of the placement drawing in device widths."""
    clusters = plan.topology.clusters
    width = sum(_cluster_width(c) for c in clusters) + GAP * (len(clusters) - 1)
    return max(width, 30.0) + 0.6, max(c.nodes for c in clusters) + 2.0 - NOTES_TOP + 0.7 * plan.pp


def _draw_placement(ax, plan: Plan) -> None:
    topo, pl, pr = plan.topology, plan.placement, plan.prediction
    where = {int(dev): (s, d) for (s, d, _), dev in np.ndenumerate(plan.grid)}
    gap, rows = GAP, max(c.nodes for c in topo.clusters)
    x, boxes, first_device = 0.0, [], 0
    for c in topo.clusters:
        colour = NIC_COLOURS.get(c.nic, "black")
        width = _cluster_width(c)
        top = rows + 0.2
        ax.add_patch(Rectangle((x, top - c.nodes - 0.45), width, c.nodes + 0.55, facecolor=colour, alpha=0.08,
                               edgecolor="none"))
        ax.add_patch(Rectangle((x, top - c.nodes - 0.45), width, c.nodes + 0.55, facecolor="none",
                               edgecolor=colour, linewidth=2))
        ax.text(x + width / 2, top + 0.25, _cluster_title(c), ha="center", va="bottom", fontsize=9, color=colour,
                fontweight="bold")
        for n in range(c.nodes):
            y = top - 1 - n
            ax.text(x + 1.0, y + 0.45, f"node {n}", ha="center", va="center", fontsize=7, color=colour)
            for k in range(c.devices_per_node):
                s, d = where[first_device + n * c.devices_per_node + k]
                ax.add_patch(Rectangle((x + 2.0 + k, y + 0.05), 0.9, 0.8, edgecolor=colour, linewidth=0.8,
                                       facecolor=STAGE_COLOURS[s % len(STAGE_COLOURS)]))
                ax.text(x + 2.45 + k, y + 0.45, f"{s}.{d}", ha="center", va="center", fontsize=6.5)
        boxes.append((x, width))
        first_device += c.num_devices
        x += width + gap

    # the stage boundaries that leave a cluster, as arrows between the clusters' frames
    home = [Counter(topo.device_cluster[plan.grid[s]].ravel().tolist()).most_common(1)[0][0] for s in range(plan.pp)]
    arcs = Counter()
    for s, r in enumerate(pl.boundary_routes):
        a, b = home[s], home[s + 1]
        if a == b:
            continue
        (xa, wa), (xb, wb) = boxes[a], boxes[b]
        start, end = (xa + wa, xb) if a < b else (xa, xb + wb)
        lift = arcs[(min(a, b), max(a, b))]
        arcs[(min(a, b), max(a, b))] += 1
        y = rows / 2 + 0.2 + lift * 1.4
        ax.add_patch(FancyArrowPatch((start, y), (end, y), arrowstyle="-|>", mutation_scale=14, linewidth=1.5,
                                     color="black", connectionstyle=f"arc3,rad={0.0 if abs(b - a) == 1 else -0.25}"))
        ax.text((start + end) / 2, y + 0.15, f"stage {s} -> {s + 1}", ha="center", va="bottom", fontsize=8)
        ax.text((start + end) / 2, y - 0.15,
                f"{r.via}\n{r.gbps:.3g} Gb/s each\n{format_seconds(pr.p2p_s[s])} per microbatch",
                ha="center", va="top", fontsize=7.5)

    # per stage: its layers and the NIC class its data groups sync over
    y0 = NOTES_TOP
    for s in range(plan.pp):
        nics = pl.data_groups_nic[s]
        colour = NIC_COLOURS.get(nics[0], "black") if len(nics) == 1 else "black"
        y = y0 - 0.7 * s
        ax.add_patch(Rectangle((0, y - 0.2), 0.9, 0.4, facecolor=STAGE_COLOURS[s % len(STAGE_COLOURS)],
                               edgecolor=colour, linewidth=1.5))
        ring = pl.data_routes[s]
        shared = f", {ring.shared_by} share a NIC" if ring.shared_by > 1 else ""
        ax.text(1.2, y, f"stage {s}: {_layers(plan.stage_layers[s])} on {pl.stage_clusters[s]}; "
                + (f"{plan.tp} data group{'s' * (plan.tp > 1)} of {plan.dp} replicas in {'+'.join(nics)}, "
                   f"syncing over {ring.via} ({ring.gbps:.3g} Gb/s each{shared}) "
                   f"in {format_seconds(pr.stage_sync_s[s])}"
                   if plan.dp > 1 else "no data parallelism"),
                ha="left", va="center", fontsize=9, color=colour)
    between = (f"; between clusters: {topo.inter_cluster.name} at {topo.inter_cluster.gbps:g} Gb/s per node"
               if len(topo.clusters) > 1 else "")  # one cluster: no such link, only its default
    ax.text(0, y0 + 0.6, f"device label: stage.replica (tensor ranks of a replica share a node){between}",
            ha="left", va="center", fontsize=8.5, color="#444444")
    width, height = _placement_extent(plan)
    ax.set_xlim(-0.3, width - 0.3)
    ax.set_ylim(rows + 2.0 - height, rows + 2.0)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(f"(b) placement ({pl.method}): clusters framed in their NIC class's colour, each device "
                 f"filled with its stage's colour", loc="left", fontsize=11)


def _mark_not_finite(ax, steps: np.ndarray, marker: str, label: str) -> None:
    """A line leaves out its nan and inf points without a trace: they are marked at the axis' foot."""
    if steps.size:
        ax.plot(steps, np.zeros(steps.size), marker, color="C3", fillstyle="none", clip_on=False,
                transform=ax.get_xaxis_transform(), label=label)


def _mark_resumes(ax, rows: list[dict]) -> None:
    """A resumed run's first step pays for warm-up again: a line where each resume starts says why
    its row stands out (the key is `metrics.RESUMED_FROM`, see typical_step_s)."""
    for r in rows:
        if "resumed_from" in r:
            ax.axvline(r["resumed_from"] + 0.5, color="#888888", linewidth=0.8, linestyle="-.",
                       label=f"resumed from step {r['resumed_from']}'s checkpoint")


def plan_from_step(rows: list[dict]) -> int | None:
    """Where a resumed workdir's plan.json comes from: each run writes its own, so it is the last
    resumed run's, whose first step this is (its prediction can differ from the earlier runs');
    None where no run resumed."""
    resumes = [r["resumed_from"] for r in rows if "resumed_from" in r]
    return resumes[-1] + 1 if resumes else None


def plan_run_rows(rows: list[dict]) -> list[dict]:
    """The rows of the run that plan.json belongs to (see plan_from_step): its measured step time is
    what the plan predicted; an earlier run's may have had another layout."""
    first = plan_from_step(rows)
    return rows if first is None else [r for r in rows if r["step"] >= first]


def typical_step_s(rows: list[dict]) -> float:
    """The median step time of metrics rows, where there are others without the run's first row
    and a resumed run's first (`metrics.RESUMED_FROM`, not imported: it would load TensorBoard's
    writer): they pay for compiling and warm-up."""
    return float(np.median([r["step_time_s"] for r in rows[1:] if "resumed_from" not in r] or
                           [r["step_time_s"] for r in rows]))


@_as_typed
def draw_report(rows: list[dict], predicted_step_s: float | None, path: str, title: str = "") -> None:
    """A run's loss and validation loss against step (left) and its measured step time against the
    plan's prediction (right), from metrics rows (holmes_jax.report reads them)."""
    steps = np.array([r["step"] for r in rows])
    fig = _figure(figsize=(13, 4.6), dpi=110)
    loss_ax, time_ax = fig.subplots(1, 2)
    loss = np.array([r["loss"] for r in rows], dtype=float)
    loss_ax.plot(steps, loss, marker=".", label="training loss (the logged step's batch)")
    _mark_not_finite(loss_ax, steps[~np.isfinite(loss)], "x", "loss not finite (the step's update skipped)")
    val = np.array([(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None], dtype=float)
    if val.size:
        loss_ax.plot(val[:, 0], val[:, 1], marker="o", linestyle="--", label="validation loss")
        _mark_not_finite(loss_ax, val[~np.isfinite(val[:, 1]), 0], "o", "validation loss not finite")
    loss_ax.set_xlabel("step")
    loss_ax.set_ylabel("loss (nats per token)")
    loss_ax.set_title("loss", loc="left")

    measured, typical = np.array([r["step_time_s"] for r in rows]), typical_step_s(plan_run_rows(rows))
    scale, unit = time_unit(typical)  # the unit `report` prints the median in
    of_run = "" if (first := plan_from_step(rows)) is None else f", the run from step {first}'s"
    time_ax.plot(steps, measured * scale, marker=".", label="measured (mean over each logged window)")
    time_ax.axhline(typical * scale, color="C0", linewidth=0.8, linestyle=":",
                    label=f"measured median {typical * scale:.4g} {unit}{of_run}")
    if predicted_step_s is not None:
        time_ax.axhline(predicted_step_s * scale, color="C3", linestyle="--",
                        label=f"plan's prediction {predicted_step_s * scale:.4g} {unit}{of_run} "
                              f"(measured / predicted = {typical / predicted_step_s:.2f})")
    top = max(measured.max(), predicted_step_s or 0)
    time_ax.set_ylim(0, 1.1 * top * scale if top > 0 else 1)  # all zero: matplotlib warned of 0 to 0
    time_ax.set_xlabel("step")
    time_ax.set_ylabel(f"step time ({unit})")
    time_ax.set_title("step time", loc="left")
    for ax in (loss_ax, time_ax):
        _mark_resumes(ax, rows)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # no step 0.96 by a lone row
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        ax.legend(frameon=False, fontsize=9, loc="upper left", bbox_to_anchor=(0, -0.14))
    if title:
        fig.suptitle(title, x=0.01, ha="left")
    fig.tight_layout()
    _save(fig, path)
