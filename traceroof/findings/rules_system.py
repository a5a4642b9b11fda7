"""Rules on the step as a whole: exposed collectives and stragglers (``exposed-collective``,
``collective-straggler``), the host holding the device back (``host-bound``), parallelism axes bound by
communication (``comm-bound-axis``), weight gradients reduced inside a loop (``gradients-in-loop``) and ops whose
executions vary widely (``outlier-executions``).

``host-bound`` reads the step breakdown (``Analysis.step_breakdown``: ``step``, ``device``, ``step_time_s``,
``compute_s``, ``exposed_comm_s``, ``launch_gap_s``, ``host_bound_s``, ``outside_program_s``) and
``comm-bound-axis`` the parallelism analysis (``Analysis.parallelism``: ``axis``, ``size``, ``strategy``,
``batch_per_device``, ``critical_batch_per_device``, ``t_math_s``, ``t_comm_s``, ``bound``, ``evidence``) when
the analysis has them."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pandas as pd

from parsers.hlo import Computation, Instruction
from traceroof.findings.hlo_graph import ModuleIndex
from traceroof.findings.record import (BOOK, MAX_OPS, Finding, FindingInputs, fmt_s, make, mean_of,
                                       share, total)
from traceroof.findings.rules_compile import compiling_steps
from traceroof.opstats import OUTLIER_RATIO
from traceroof.units import fmt_bytes, fmt_list

COLLECTIVE_SOURCE = (f"{BOOK} §1 (overlapping communication with compute: T = max(T_math, T_comms)) and §5 "
                     "(FSDP prefetch, reduce-scatter overlap); XLA latency-hiding scheduler flags")
STRAGGLER_SOURCE = "traceroof arrival skew (collectives wait for the last device to arrive)"
HOST_SOURCE = ("XProf overview page and trace viewer guidance (input-bound / host-bound steps); JAX docs, "
               "asynchronous dispatch")
AXIS_SOURCE = (f"{BOOK} §5 (data / FSDP parallelism is compute-bound only while batch per device exceeds the "
               "critical batch C/W; tensor parallelism while the model dim per shard stays large) and §12 (GPUs)")
OUTLIER_SOURCE = "traceroof execution statistics (median and p90 of single executions)"

EXPOSED_SHARE_MIN = 0.02  # collectives exposed for more than this share of the step are named
STRAGGLER_LAST_SHARE_MIN = 0.5  # a device last at more than this share of collective executions ...
STRAGGLER_WAIT_SHARE_MIN = 0.01  # ... while the others wait more than this share of the step
HOST_BOUND_SHARE_MIN = 0.05  # host-bound fires when the device waits on the host this share of the step
BUSY_SHARE_MIN = 0.5  # without a step breakdown: ops covering less of the step than this
ASYNC_FLAGS = {"tpu": "XLA_FLAGS=--xla_tpu_enable_async_collective_fusion=true "
                      "--xla_tpu_overlap_compute_collective_tc=true",
               "gpu": "XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true (and "
                      "--xla_gpu_enable_pipelined_all_gather / _reduce_scatter / _all_reduce)"}
KIND_ADVICE = {"all-gather": "prefetch it a layer ahead (FSDP overlap) or let XLA schedule it async",
               "reduce-scatter": "overlap it with the next layer's backward (async collective)",
               "all-reduce": "split it into reduce-scatter + all-gather that overlap compute, or shard the "
                             "operand so it shrinks",
               "all-to-all": "overlap dispatch with expert compute (chunk the all-to-all)"}
LATENCY_ADVICE = ("its cost on these links is the fixed latency, not its bytes (splitting or sharding it would not "
                  "help): combine it with neighbouring collectives of its kind (XLA's combiner passes merge those "
                  "close in the schedule), or take it out of the step (a logged scalar reduced less often)")


def exposed_collective(x: FindingInputs) -> list[Finding]:
    """The (up to 3) collectives exposed for more than ``EXPOSED_SHARE_MIN`` of the step, one finding each, with
    what would hide them. Lost: the exposed time. Virtual CPU devices (threads of one host) get no interconnect
    advice: their collectives are threads waiting for each other while the others compute on the shared cores,
    no time the program could win (worth NaN, severity info, as device-idle's; s36 trial: ranked high with 34 %
    "lost" under a header at 102 % of the host's roofline); across CPU hosts the wait includes the network and
    keeps its time."""
    t = x.analysis.collectives
    if t is None or t.empty or not x.step_s > 0:
        return []
    hot = np.flatnonzero(t["exposed_per_step_s"].to_numpy(np.float64) > EXPOSED_SHARE_MIN * x.step_s)[:3]
    out = []
    need = ("hlo_op", "kind", "bytes_out", "group_size", "exposed_per_step_s", "exposed_share",
            "expected_per_step_s", "link", "arrival_skew_s", "bound")
    values = {c: (t[c].to_numpy() if c in t else np.full(len(t), ""))[hot].tolist() for c in need} \
        if len(hot) else {}  # not a row Series each (a table without the bound column: none latency-bound)
    for i in range(len(hot)):
        r = SimpleNamespace(**{c: v[i] for c, v in values.items()})
        rows = np.flatnonzero(x.cols.text("hlo_op") == r.hlo_op)
        what = f"{r.hlo_op} ({r.kind}, {fmt_bytes(r.bytes_out)}, group {r.group_size})"
        evidence = [f"exposed {fmt_s(r.exposed_per_step_s)} per step, {r.exposed_share:.0%} of its window"
                    if np.isfinite(r.exposed_share) else f"exposed {fmt_s(r.exposed_per_step_s)} per step",
                    f"expected {fmt_s(r.expected_per_step_s)} on {r.link or 'the links'}"
                    if np.isfinite(r.expected_per_step_s) else ""]
        if x.virtual_devices:
            skew = r.arrival_skew_s if np.isfinite(r.arrival_skew_s) else 0.0
            title = f"{what} takes {fmt_s(r.exposed_per_step_s)} per step on virtual CPU devices"
            hosts = x.analysis.summary.hosts
            on = "on shared cores" if hosts <= 1 else f"across {hosts} hosts"
            how = "" if hosts <= 1 else "; threads sharing each host's cores, processes joined over the network"
            advice = (f"mostly devices waiting for each other {on} (arrival skew {fmt_s(skew)}{how}), not "
                      "data movement: profile on the real accelerators to judge it")
        else:
            exposed = r.exposed_per_step_s
            title = f"{what} is exposed {fmt_s(exposed)} per step ({share(exposed, x.step_s)})"
            flags = ASYNC_FLAGS.get(x.chip.kind if x.chip is not None else "", "")
            advice = (f"a latency-bound {r.kind} of {fmt_bytes(r.bytes_out)}: {LATENCY_ADVICE}" if r.bound == "latency"
                      else KIND_ADVICE.get(r.kind, "make it asynchronous so compute can overlap it")
                      + (f"; scheduler flags to try: {flags}" if flags else ""))
        worth = float("nan") if x.virtual_devices and x.analysis.summary.hosts <= 1 else float(r.exposed_per_step_s)
        out.append(make(x, "exposed-collective", title, worth, advice, COLLECTIVE_SOURCE, evidence, rows,
                        ops=(r.hlo_op,)))
    return out


def collective_straggler(x: FindingInputs) -> list[Finding]:
    """A device, or every device of one host, that arrives last at most collective executions while the others
    wait. Lost per step, per device as the step time is: up to the arrival skew (Σ over executions of
    ``skew_s``, latest less earliest arrival: what the step saves when the late one's delay is waste, such as a
    host's input stall); the mean wait of a device (``wait_s`` / ``devices``: latest less mean arrival, what
    balancing the work before the collectives saves) is the evidence. ``wait_s`` itself is a sum over devices: read
    as the loss, a user's 8 devices waiting 30 ms each made 120 ms of a 270 ms step."""
    skew = x.skew
    if skew is None or skew.empty or not x.steps:
        return []
    last = skew["last_device"].astype(str)
    wait = float((skew["wait_s"] / skew["devices"]).sum()) / x.steps
    lost = float(skew["skew_s"].sum()) / x.steps
    host = _host_of(last)
    top_device, top_host = last.value_counts(), host.value_counts()
    if x.analysis.summary.hosts > 1 and top_host.iloc[0] > top_device.iloc[0]:  # the last device changes, its host does not
        name, n = str(top_host.index[0]), int(top_host.iloc[0])
        who = f"{name}'s devices ({last[host == name].nunique()} of them, in turn) arrive"
        cause = "its input pipeline or Python work, a busier or slower machine, uneven shards"
    else:
        who, n = f"{top_device.index[0]} arrives", int(top_device.iloc[0])
        cause = "uneven shards, host input on its host, a slower chip or thermal throttling"
    if not (n / len(skew) > STRAGGLER_LAST_SHARE_MIN and wait > STRAGGLER_WAIT_SHARE_MIN * x.step_s):
        return []
    title = (f"{who} last at {n / len(skew):.0%} of collective executions; the first devices wait up to "
             f"{fmt_s(lost)} per step for the last (straggler)")
    evidence = [f"a device waits {fmt_s(wait)} per step on average (latest less mean arrival), over "
                f"{len(skew):,} collective executions"]
    advice = (f"find what arrives late before the collectives ({cause}) and remove or balance it: removing a "
              f"delay saves up to {fmt_s(lost)} per step, balancing work {fmt_s(wait)}")
    ops = tuple(skew["hlo_op"].astype(str).value_counts().index[:5]) if "hlo_op" in skew else ()
    return [make(x, "collective-straggler", title, lost, advice, STRAGGLER_SOURCE, evidence, None, ops=ops)]


def _host_of(devices: pd.Series) -> pd.Series:
    """The host of each device name (``<host>/<device>``, as :mod:`traceroof.events` names devices)."""
    return devices.astype(str).str.split("/", n=1).str[0]


def host_bound(x: FindingInputs) -> list[Finding]:
    """The device idle while the host works: from the step breakdown (mean ``host_bound_s`` per step and
    device), else from the share of the step no op covers. Lost: that idle time."""
    b = x.table("step_breakdown")
    advice = ("feed the device ahead of time (prefetch the next batch to the device, e.g. "
              "jax.device_put of batch n+1 while step n runs, a prefetching data loader), keep Python work and "
              "device-to-host reads (float(loss), .item(), jax.device_get, block_until_ready) out of the loop, "
              "and put more of the step under one jit (lax.scan over micro-steps)")
    if b is not None:
        need = {"step_time_s", "host_bound_s"}
        if not need <= set(b.columns):
            return []
        step = mean_of(b["step_time_s"])
        compiling = b["step"].isin(compiling_steps(b).index).to_numpy(bool) if "step" in b else np.zeros(len(b), bool)
        lost = mean_of(b["host_bound_s"].where(~compiling, 0.0))  # a compiling step's wait is recompile's
        if not (step > 0 and lost >= HOST_BOUND_SHARE_MIN * step):
            return []
        b = b[~compiling] if compiling.any() else b
        extra = [f"{c.removesuffix('_s').replace('_', ' ')} {fmt_s(mean_of(b[c]))}"
                 for c in ("compute_s", "exposed_comm_s", "launch_gap_s", "outside_program_s") if c in b]
        shares = [c for c in b.columns if c.startswith("host_bound_") and c.endswith("_share")]
        kinds = {c.removeprefix("host_bound_").removesuffix("_share"): mean_of(b[c]) for c in shares
                 if not np.isnan(b[c].to_numpy(np.float64)).all()}
        busy = ", ".join(f"{k} {v:.0%}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]) if v > 0.05)
        title = (f"the device waits on the host {fmt_s(lost)} per step ({lost / step:.1%} of the step; host threads "
                 f"busy with {busy or 'untraced work'})" + _one_host(b))
        return [make(x, "host-bound", title, lost, advice, HOST_SOURCE,
                     [f"mean over {len(b)} step x device rows: step {fmt_s(step)}, " + ", ".join(extra)])]
    s = x.analysis.summary
    if not (s.step_time_mean_s > 0 and s.op_time_per_step_s > 0):
        return []
    busy = s.op_time_per_step_s / s.step_time_mean_s
    if busy >= BUSY_SHARE_MIN:
        return []
    lost = s.step_time_mean_s - s.op_time_per_step_s
    title = f"ops cover {busy:.0%} of the step time: the rest is host overhead, input or idle gaps"
    return [make(x, "host-bound", title, lost, advice, HOST_SOURCE,
                 [f"op time {fmt_s(s.op_time_per_step_s)} of a {fmt_s(s.step_time_mean_s)} step (no step "
                  "breakdown: gaps are not split into host, launch and outside-program time)"])]


def _one_host(breakdown: pd.DataFrame) -> str:
    """', mostly on <host> (...)' when the step breakdown's devices are on several hosts and one host's mean
    ``host_bound_s`` is more than twice every other host's: the mean over hosts hides where the host work is (a
    user's 2-host job: 15.5 ms per step, 30.7 ms on one host and 0.4 ms on the other); else ''."""
    if "device" not in breakdown or breakdown.empty:
        return ""
    per = breakdown["host_bound_s"].astype(float).groupby(_host_of(breakdown["device"]).to_numpy()).mean()
    if len(per) < 2:
        return ""
    top = per.idxmax()
    rest = float(per.drop(top).max())
    if not per[top] > 2 * rest:
        return ""
    return (f", mostly on {top} ({fmt_s(float(per[top]))} per step there, at most {fmt_s(rest)} on the other "
            f"{len(per) - 1} host(s))")


IDLE_SHARE_MIN = 0.2  # device-idle fires when launch gaps + time outside programs exceed this share of the step
IDLE_SOURCE = ("XProf overview page (device idle time); JAX docs, asynchronous dispatch and jax.jit of whole "
               "steps")


def device_idle(x: FindingInputs) -> list[Finding]:
    """The device idle with no host work in the way: launch gaps inside programs and time outside any program
    (step breakdown). Lost: that idle time."""
    b = x.table("step_breakdown")
    if b is None or not {"step_time_s", "launch_gap_s", "outside_program_s"} <= set(b.columns):
        return []
    step, gaps, outside = (mean_of(b[c]) for c in ("step_time_s", "launch_gap_s", "outside_program_s"))
    idle = gaps + outside
    if not (step > 0 and idle > IDLE_SHARE_MIN * step):
        return []
    title = (f"the device idles {fmt_s(idle)} per step ({idle / step:.0%}) with no host work in the way: "
             f"{fmt_s(gaps)} of launch gaps inside programs, {fmt_s(outside)} between programs")
    programs = len({m for m in x.cols.text("module") if m is not None}) if "module" in x.counted else 1
    shared = x.virtual_devices and x.analysis.summary.devices > 1  # several device threads on one host's cores
    if shared:
        title += " on virtual CPU devices"
        advice = ("virtual CPU devices are threads sharing the host's cores: their idle time is mostly thread "
                  "scheduling, not the program; profile on the real accelerators before acting on it")
    elif gaps >= outside:
        advice = ("many short ops leave the device waiting for each launch: fewer, larger ops (a bigger batch "
                  "per step, fusion-friendly code without reshapes between elementwise ops; on GPU, command "
                  "buffers / CUDA graphs: XLA_FLAGS=--xla_gpu_enable_command_buffer)")
    elif programs > 1:
        advice = (f"the step runs {programs} programs with the device idle between them: put the step's work "
                  "under one jax.jit (no separate jits for metrics or updates), or lax.scan over micro-steps")
    else:
        advice = ("the device waits between executions of the step's program: keep the host ahead (no blocking "
                  "reads of results in the loop) and dispatch the next step before reading this one's results")
    worth = float("nan") if shared else idle  # scheduling of threads: no time to win in the program
    return [make(x, "device-idle", title, worth, advice, IDLE_SOURCE,
                 [f"mean over {len(b)} step x device rows: step {fmt_s(step)}; {programs} program(s) per step"])]


def comm_bound_axis(x: FindingInputs) -> list[Finding]:
    """Parallelism axes whose communication outlasts their math (the parallelism analysis' ``bound`` column,
    or ``t_comm_s`` > ``t_math_s``), with the book's remedy for the axis' strategy. Lost: the communication
    time beyond the math it could hide under."""
    p = x.table("parallelism")
    report = getattr(x.analysis, "parallelism", None)
    if p is None and getattr(report, "rows", None):  # traceroof.mesh_book.ParallelismReport
        remedy = {axis: (title, advice) for axis, title, advice in report.findings}
        p = pd.DataFrame([{**dataclasses.asdict(r), "lost_s": r.measured_exposed_s,
                           "title": remedy.get(r.axis, ("", ""))[0], "advice": remedy.get(r.axis, ("", ""))[1]}
                          for r in report.rows if r.axis in remedy])
    if p is None or p.empty or not {"axis", "t_math_s", "t_comm_s"} <= set(p.columns):
        return []
    out = []
    for r in p.to_dict("records"):
        t_math, t_comm = float(r.get("t_math_s", np.nan)), float(r.get("t_comm_s", np.nan))
        bound = str(r.get("bound", ""))
        if not (bound.startswith("comm") or (np.isfinite(t_comm) and np.isfinite(t_math) and t_comm > t_math)):
            continue
        strategy = str(r.get("strategy", "")).lower()
        b, crit = r.get("batch_per_device", np.nan), r.get("critical_batch_per_device", np.nan)
        if any(k in strategy for k in ("fsdp", "data", "dp", "zero")):
            advice = (f"raise the batch per device above the critical batch (now {b:.4g}, needs about {crit:.4g}), "
                      "or shard fewer ways on this axis and more on a model axis; keep the axis on the fastest "
                      "links (ICI / NVLink rather than DCN)")
        elif any(k in strategy for k in ("tensor", "model", "tp", "megatron")):
            advice = ("use fewer tensor-parallel ways on this axis (the model dim per shard is too small for the "
                      "links) and more data / FSDP parallelism, or keep the axis inside the fastest link domain")
        elif "expert" in strategy or "ep" == strategy:
            advice = ("reduce the all-to-all volume: fewer experts per token (top-k), a lower capacity factor, or "
                      "expert parallelism over fewer, closer devices")
        elif "pipe" in strategy:
            advice = "use more microbatches per step so pipeline transfers overlap compute"
        else:
            advice = "overlap this axis' collectives with compute or move it to faster links"
        lost = max(t_comm - (t_math if np.isfinite(t_math) else 0.0), 0.0)
        in_pass = f" ({r['book_pass']} pass)" if r.get("book_pass") else ""
        ev = [f"T_math {fmt_s(t_math)}, T_comm {fmt_s(t_comm)} per layer{in_pass}",
              f"batch per device {b:.4g}, critical {crit:.4g}" if np.isfinite(b) and np.isfinite(crit) else "",
              str(r.get("evidence", "") or "")]
        title = f"axis {r['axis']} ({strategy or 'unknown strategy'}, size {r.get('size', '?')}) is communication-bound"
        if r.get("title"):  # the parallelism report's own: the book's remedy; worth the axis' measured exposed time
            title, advice = str(r["title"]), str(r["advice"])
            lost = float(r["lost_s"]) if np.isfinite(r.get("lost_s", np.nan)) else float("nan")
            ev[0] += "; the time lost is the axis' measured exposed communication per step"
            if x.virtual_devices:  # measured on threads of one host waiting for each other: not the target's
                lost = float("nan")
                ev[0] += ("; not here: these devices are threads of one CPU host, whose collectives are waits, so "
                          "the time the target would lose is not measured (the verdict is the book's estimate)")
        out.append(make(x, "comm-bound-axis", title, lost, advice, AXIS_SOURCE, ev))
    return out


def outlier_executions(x: FindingInputs) -> list[Finding]:
    """Ops with executions slower than ``OUTLIER_RATIO`` x their median (noise, contention, first-run effects).
    Lost: their time above median x executions."""
    st = x.stats
    if st is None or st.empty or not (st["outlier_executions"].to_numpy() > 0).any():
        return []
    flagged = st[st["outlier_executions"] > 0]
    flagged = flagged.assign(_excess=flagged["max_s"] - flagged["median_s"]).sort_values(
        ["_excess"], ascending=False, kind="stable")
    names = {str(op) for _, _, op in flagged.index}
    c = x.cols
    rows = np.flatnonzero(c.isin("hlo_op", names))
    med = (flagged.reset_index().assign(hlo_op=lambda d: d["hlo_op"].astype(str))
           .groupby("hlo_op")["median_s"].first().to_dict())
    median_s = np.array([med.get(n, np.nan) for n in c.text("hlo_op")[rows]], np.float64)
    excess = c.num("measured_s")[rows] - median_s * c.num("executions")[rows]
    lost = total(np.where(excess < 0, 0.0, excess)) / x.per
    evidence = [f"{op}: {int(r.outlier_executions)} of {r.samples:g} runs, up to {fmt_s(r.max_s)} vs median "
                f"{fmt_s(r.median_s)}" for (_, _, op), r in zip(flagged.index[:4], flagged.itertuples(index=False))]
    title = f"{len(flagged)} op(s) have executions more than {OUTLIER_RATIO:g}x their median time"
    advice = ("not the ops' typical cost (top ops are ranked by median): profile more steps after a warm-up, on "
              "an otherwise idle machine, and exclude compile/first-run steps (--warmup-steps)")
    if x.virtual_devices and x.analysis.summary.devices > 1:  # several device threads on one host's cores
        # s40 trial: ranked first, 184 ms "lost" per step, on 8 virtual devices time-slicing 2 cores
        title += " on virtual CPU devices"
        advice = ("virtual CPU devices are threads sharing the host's cores: a run that waited while other device "
                  "threads held the cores looks slow; not the program's cost and no time to win in it: profile on "
                  "the real accelerators (or on one device) before acting on it")
        lost = float("nan")
    ops = tuple(str(op) for _, _, op in flagged.index[:MAX_OPS])
    return [make(x, "outlier-executions", title, lost, advice, OUTLIER_SOURCE, evidence, rows, ops=ops)]


LOOP_SOURCE = (f"{BOOK} §5 (data parallelism and FSDP: the gradients are reduced once per step, after the "
               "backward pass); JAX docs, jax.shard_map (gradients per device, reduced once with jax.lax.pmean)")


_SAME_VALUE = ("get-tuple-element", "bitcast", "reshape", "copy", "convert", "transpose")  # a value moved, not summed
_MAX_HOPS = 16  # users followed from a collective before giving up (a corrupt module's cycle ends there)


def _stacked_per_iteration(got: tuple[ModuleIndex, Instruction] | None) -> bool:
    """Whether every value a collective produces ends, through :data:`_SAME_VALUE` ops and fusion parameters,
    as the update operand of a ``dynamic-update-slice``: written into the loop iteration's own slice of a stacked
    array (``jax.lax.scan`` over layers stacks each layer's weight gradient), not added to a carried sum."""
    if got is None:
        return False
    ix, inst = got
    comp = ix.computation_of(inst.name)
    return comp is not None and _ends_in_update(ix, comp, inst.name, 0)


def _ends_in_update(ix: ModuleIndex, comp: Computation, name: str, hops: int) -> bool:
    users = ix.users(comp).get(name, [])
    if not users or hops > _MAX_HOPS:
        return False
    for u in users:
        if u.opcode in _SAME_VALUE:
            ok = _ends_in_update(ix, comp, u.name, hops + 1)
        elif u.opcode == "dynamic-update-slice":
            ok = len(u.operands) > 1 and u.operands[1] == name and u.operands[0] != name
        elif u.opcode == "fusion" and len(u.called) == 1 and u.called[0] in ix.module.computations:
            inner = ix.module.computations[u.called[0]]
            params = inner.parameters()
            ok = all(k in params and _ends_in_update(ix, inner, params[k].name, hops + 1)
                     for k, o in enumerate(u.operands) if o == name)
        else:
            ok = False
        if not ok:
            return False
    return True


def _loop_updates(got: tuple[ModuleIndex, Instruction] | None, optimizer_ops: set[tuple[str, str]]) -> bool:
    """Whether the loop that runs a collective also runs optimizer ops (``optimizer_ops``: (module, HLO op) of
    the op rows of phase ``optimizer``): the weights are updated every iteration (sequential minibatch updates,
    as PPO's epochs do), so each iteration's gradient must be reduced before the next and one reduction after the
    loop would change the algorithm (s39 trial: "reduce once" promised 108 ms per step that cannot be had)."""
    if got is None:
        return False
    ix, inst = got
    comp = ix.computation_of(inst.name)
    body = ix.loop_body(comp) if comp is not None else None
    if body is None:
        return False
    loop = ix.run_by(body)
    return any(m == ix.module.name and (oc := ix.computation_of(op)) is not None and oc.name in loop
               for m, op in optimizer_ops)


def gradients_reduced_in_loop(x: FindingInputs) -> list[Finding]:
    """Weight gradients reduced over a data-parallel or FSDP axis several times per step: XLA's SPMD partitioner
    put the all-reduce (or reduce-scatter) inside a loop of the backward pass (a scan over time steps or
    micro-batches), so it runs once per iteration, each time moving the loop's whole weight gradient (a s34
    trial's LSTM: 64 all-reduces per step, 59 MB where the gradients are 1 MB). Gradient collectives are those
    the parallelism section read as gradients (``ParallelismReport.gradient_ops``, of the module it analysed).
    Lost: the collectives' time per step less one execution each (one reduction after the loop moves the same
    bytes once). A collective whose results each iteration writes into its own slice of a stacked gradient (a
    scan over layers: every iteration reduces another layer's weights) is not repeated work and is left out
    (:func:`_stacked_per_iteration`; a s36 trial's GNN scanned over 4 layers was told to reduce once, which moved
    the same bytes and ran 30 % slower). Neither is one in a loop that also updates the weights
    (:func:`_loop_updates`)."""
    t, p = x.analysis.collectives, getattr(x.analysis, "parallelism", None)
    if t is None or t.empty or p is None or not p.gradient_ops:
        return []
    execs = t["executions_per_step"].to_numpy(np.float64)
    ours = (t["module"].astype(str).to_numpy() == p.module) & np.isin(t["hlo_op"].astype(str).to_numpy(),
                                                                      list(p.gradient_ops))
    hot = np.flatnonzero(ours & (execs >= 2))
    got = [x.programs.instruction(t["module"].iloc[i], None, t["hlo_op"].iloc[i]) for i in hot]  # (by name)
    c = x.cols
    opt = c.text("phase") == "optimizer"
    optimizer_ops = set(zip(c.text("module")[opt], c.text("hlo_op")[opt])) if len(got) else set()
    hot = np.array([i for i, g in zip(hot, got)
                    if not _stacked_per_iteration(g) and not _loop_updates(g, optimizer_ops)], np.int64)
    if not len(hot):
        return []
    ops = tuple(t["hlo_op"].astype(str).to_numpy()[hot])
    time_s, bytes_out = t["time_per_step_s"].to_numpy(np.float64)[hot], t["bytes_out"].to_numpy(np.float64)[hot]
    lost = float(np.nansum(time_s * (1 - 1 / execs[hot])))
    n = int(round(float(np.max(execs[hot]))))
    title = (f"weight gradients are reduced inside a loop, {n} times per step: {len(ops)} collective(s) move "
             f"{fmt_bytes(float(np.sum(bytes_out * execs[hot])))} per step where one reduction after the loop "
             f"would move {fmt_bytes(float(np.sum(bytes_out)))}")
    evidence = [f"{fmt_list(ops, MAX_OPS)}: " + ", ".join(f"{fmt_bytes(b)} x {e:g}" for b, e in
                                                          zip(bytes_out, execs[hot])),
                f"{fmt_s(float(np.nansum(time_s)))} per step in them" + (
                    " (on virtual CPU devices mostly devices waiting for each other at each of the reductions)"
                    if x.virtual_devices else "")]
    advice = ("XLA reduces the gradient of the loop's weights over the batch axis at every iteration of the "
              "backward loop (a scan over time steps or micro-batches under jax.jit with a sharded batch). Reduce "
              "once: compute the gradients per device inside jax.shard_map over the batch axis and average them "
              "with jax.lax.pmean after jax.grad, or accumulate micro-batch gradients locally and reduce the sum")
    rows = np.flatnonzero(np.isin(x.cols.text("hlo_op"), ops))
    return [make(x, "gradients-in-loop", title, lost, advice, LOOP_SOURCE, evidence, rows, ops=ops)]
