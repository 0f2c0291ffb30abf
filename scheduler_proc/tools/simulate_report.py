"""What the slot simulator shows: the printed comparison, and one PNG timeline per policy (a row
per slot, a column per step, coloured by seat state).

matplotlib is imported inside the drawing function only, so importing this module (or the
simulator) costs the scheduler process nothing.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from scheduler_proc.tools.simulate import GENERATING, SimResult, Workload

# Display codes: the seat states of scheduler_proc.tools.simulate (IDLE 0, GENERATING 1, HELD 2), plus
# 3 for a generating seat's every other occupant, so consecutive requests in one seat show apart.
DISPLAY_COLOURS = ("#e8e8e8", "#2b7bba", "#e6550d", "#8cc0e3")
LEGEND = (("#2b7bba", "generating (shade changes: the next request boarded)"),
          ("#e6550d", "finished, still holding the seat"), ("#e8e8e8", "idle"))


def report(workload: Workload, step_ms: float, num_slots: int, results: list[SimResult],
           within_steps: int) -> str:
    """The printed comparison, one column per policy, under a line saying what the trace holds."""
    lengths = sorted(workload.lengths)
    prompt_lens = [len(prompt) for prompt in workload.prompts]
    rows = [("steps until all finished", lambda r: str(r.num_steps)),
            (f"completed within {within_steps} steps", lambda r: f"{r.completed_within(within_steps)}"
                                                                f"/{len(r.finish_steps)}"),
            ("slot utilisation", lambda r: f"{100 * r.slot_utilisation:.1f}%"),
            ("padding waste", lambda r: f"{100 * r.padding_waste:.1f}%"),
            ("mean latency (steps)", lambda r: f"{r.mean_latency_steps:.1f}")]
    median = "" if lengths[0] == lengths[-1] else f" (median {lengths[len(lengths) // 2]})"
    lines = [f"{len(lengths)} requests, output lengths {_span(lengths)}{median}, "
             f"prompts of {_span(prompt_lens)} token(s), arriving over steps 0..{workload.arrival_steps[-1]} "
             f"({step_ms:g} ms a step); {num_slots} slots",
             f"{'':<32}" + "".join(f"{r.policy:>12}" for r in results)]
    lines += [f"{name:<32}" + "".join(f"{cell(r):>12}" for r in results) for name, cell in rows]
    return "\n".join(lines)


def _span(values: list[int]) -> str:
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}..{high}"


def display_codes(result: SimResult) -> np.ndarray:
    """int8 [num_slots, num_steps] colour indices into DISPLAY_COLOURS; a seat's 2nd, 4th, ...
    occupant is drawn in the lighter blue, so each boarding shows as a change of shade."""
    occupants = result.occupants  # int32 [num_slots, num_steps]
    previous = np.pad(occupants[:, :-1], ((0, 0), (1, 0)), constant_values=-1)  # int32 [num_slots, num_steps]
    boards = (occupants != previous) & (occupants >= 0)  # bool [num_slots, num_steps]
    nth_occupant = np.cumsum(boards, axis=1)  # int [num_slots, num_steps]
    lighter = (result.timeline == GENERATING) & (nth_occupant % 2 == 0)
    return np.where(lighter, 3, result.timeline).astype(np.int8)


def write_timeline(result: SimResult, path: Path, within_steps: int, num_steps_axis: int = 0) -> Path:
    """Draw `result`'s timeline to `path` (parent directories are created) and return the path.
    `num_steps_axis` widens the x axis (and figure) so two policies' timelines share one scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    path.parent.mkdir(parents=True, exist_ok=True)
    num_slots, num_steps = result.timeline.shape
    x_max = max(num_steps, num_steps_axis)
    fig, ax = plt.subplots(figsize=(min(16.0, max(8.0, x_max / 40)), 1.5 + 0.3 * min(num_slots, 32)))
    ax.imshow(display_codes(result), aspect="auto", interpolation="nearest", vmin=0,
              vmax=len(DISPLAY_COLOURS) - 1, cmap=ListedColormap(DISPLAY_COLOURS),
              extent=(0, num_steps, num_slots, 0))
    ax.set_xlim(0, x_max)
    if within_steps < x_max:
        ax.axvline(within_steps, color="black", linewidth=1, linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel("slot")
    ticks = range(num_slots) if num_slots <= 32 else []
    ax.set_yticks([s + 0.5 for s in ticks], [str(s) for s in ticks])
    ax.set_title(f"{result.policy}: all done at step {result.num_steps}; "
                 f"{result.completed_within(within_steps)}/{len(result.finish_steps)} within {within_steps} "
                 f"(dashed); utilisation {100 * result.slot_utilisation:.0f}%, padding "
                 f"{100 * result.padding_waste:.0f}%, mean latency {result.mean_latency_steps:.1f} steps",
                 fontsize=9)
    ax.legend(handles=[Patch(color=c, label=n) for c, n in LEGEND], loc="upper left",
              bbox_to_anchor=(0.0, -0.12 - 1.0 / max(num_slots, 4)), ncol=3, frameon=False, fontsize=8)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
