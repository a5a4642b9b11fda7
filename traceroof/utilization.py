"""Whole-step figures: step times (the step period on the devices; device vs host annotation), MFU and HFU, and
notes on figures that cannot be right."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd

from traceroof.codes import as_text
from traceroof.units import fmt_si, fmt_time


STEP_TIME_DISAGREEMENT = 0.1  # device vs host-annotation step time differing by more than this get a note
DEVICE_SPAN = "from the later of its first launch and the previous step's last op end, to its last op end"
SHARED_HOST = "devices share this host and its calibrated peak"  # the notes that qualify MFU, HFU and efficiency
IMPOSSIBLE = "outside 0-100 % of the"
PEAK_TOO_LOW = "the peak is below what this machine reached"
MFU_CAVEATS = (SHARED_HOST, IMPOSSIBLE, PEAK_TOO_LOW)  # --format summary prints these under its MFU line
FASTER_THAN_ROOF_RATIO = 1.5  # expected > this x measured: the model or the chip figures are off
ABOVE_PEAK_RATIO = 1.2  # an op's FLOP/s over this x the peak: the peak is wrong, not the op (timer noise, rounding)
OVERLAP_RATIO = 1.05  # op time per step above this multiple of the step time: ops overlapped (a note)
SIGNIFICANT_OP_SHARE = 0.01  # ops with less of the op time are too short to judge a FLOP rate from


def _step_durations(sel: pd.DataFrame, notes: list[str], marked: bool = True) -> tuple[np.ndarray, float]:
    """Per-step times (s) of the used steps: the device time (:data:`DEVICE_SPAN`, see
    :func:`traceroof.steps.device_step_spans`) where every step has one, else the annotation's; and the
    annotations' mean. For ``marked`` steps (annotations, not executions) a note says when the two differ by more
    than ``STEP_TIME_DISAGREEMENT``, and which side waits. A step annotated on several hosts is one step whose
    duration is the mean of each host's own (annotation, and :data:`DEVICE_SPAN` on its devices), so the
    number of hosts changes neither the mean nor the spread, and the hosts' clock offsets (aligned only to
    ``profile_start_time``, NTP-close) do not stretch it as a span over hosts would. Devices' own ``Steps`` lines
    (TPU, framework profiles) number their steps per device and stay one sample each."""
    host_ps = (sel["end_ps"] - sel["start_ps"]).astype("float64")
    spans = "device_start_ps" in sel and "device_end_ps" in sel
    device_ps = (sel["device_end_ps"] - sel["device_start_ps"]).astype("float64") if spans else None
    per_host = "device" not in sel or sel["device"].isna().all()  # host annotations, not devices' Steps lines
    if len(sel) and "step" in sel and per_host and sel["step"].duplicated().any():
        host_ps = host_ps.groupby(sel["step"], sort=True).mean()
        if device_ps is not None:  # NaN for a step where a host has no device span (numpy's mean keeps NaN)
            missing = device_ps.isna().groupby(sel["step"], sort=True).any()
            device_ps = device_ps.groupby(sel["step"], sort=True).mean().where(~missing)
    host = _valid_steps(host_ps.to_numpy(np.float64) * 1e-12, "step annotations", notes)
    host_mean = float(host.mean()) if len(host) else float("nan")
    if not len(sel) or device_ps is None or device_ps.isna().any():
        return host, host_mean
    device = _valid_steps(device_ps.to_numpy(np.float64) * 1e-12, f"device steps ({DEVICE_SPAN})", notes)
    if not len(device):
        return host, host_mean
    dev_mean = float(device.mean())
    if marked and abs(dev_mean - host_mean) > STEP_TIME_DISAGREEMENT * max(dev_mean, 1e-30):
        why = ("asynchronous dispatch: the host runs ahead of the device" if dev_mean > host_mean else
               "the host spends longer per step than the device: Python, dispatch or input work")
        notes.append(f"device step time ({DEVICE_SPAN}) {dev_mean * 1e3:.3f} ms differs from the "
                     f"step annotations' {host_mean * 1e3:.3f} ms ({why})")
    return device, host_mean


def step_periods(breakdown: pd.DataFrame, used: tuple[int, ...] | list[int], fallback_s: np.ndarray,
                 notes: list[str]) -> np.ndarray:
    """Per-step times (s) of the ``used`` steps, in step order: each step's period on the devices, from the end
    of the previous step to its own, less the programs launched outside the steps that ran in it
    (:mod:`traceroof.breakdown`'s ``step_time_s``, averaged over the devices), so that the time a blocking loop
    spends in Python between steps counts, as it does on the wall clock, and MFU is work over the time a step
    really takes. ``fallback_s`` (:func:`_step_durations`' times) for a profile without a timeline (no
    breakdown), and, with a note saying so, where the breakdown does not cover every used step."""
    if breakdown.empty or not len(used):
        return fallback_s
    per_step = breakdown.groupby("step", sort=True)["step_time_s"].mean()
    covered = per_step.index.isin(list(used))
    if len(per_step) != len(used) or not covered.all():
        notes.append(f"the step breakdown covers {int(covered.sum())} of the {len(used)} steps used: step time is "
                     f"each step's own span ({DEVICE_SPAN}, or its annotation), not its period from the "
                     "previous step's end: time between steps is left out of it, and MFU is higher")
        return fallback_s
    return per_step.to_numpy(np.float64)


def _valid_steps(durations_s: np.ndarray, what: str, notes: list[str]) -> np.ndarray:
    """The step durations (s) that are positive and finite; the others (an end before its start, times that
    wrapped or overflowed) are dropped with a note saying how many."""
    ok = np.isfinite(durations_s) & (durations_s > 0)
    if not ok.all():
        bad = durations_s[~ok]
        notes.append(f"{len(bad)} of {len(durations_s)} {what} have a duration that is not a positive time "
                     f"({', '.join(f'{x:.3g} s' for x in bad[:3])}): the profile's times are inconsistent "
                     "(an end before its start, or wrapped timestamps); those steps are left out of the step time")
    return durations_s[ok]


ROUTING = "one-hot routing matmuls (an MoE's dispatch and combine einsums: they move tokens)"


def flop_utilization(counted: pd.DataFrame, per: float, step_s: float, peak: float | None, program_devices: int,
                     model_flops_per_step: float | None = None) -> tuple[float, str, float, float]:
    """(model FLOPs per step per device, where they came from, MFU, HFU).

    Model FLOPs: the user's whole-program count per step (e.g. 6·N·T) ÷ ``program_devices``, else the matmul
    FLOPs (``matmul_flops``: dots, convolutions, GEMM and attention calls) of ``counted`` rows without the
    rematerialised forward (phase ``remat``, or XProf's remat flag) and the optimizer update (phase
    ``optimizer``) and the one-hot routing dots (``routing_flops``: an MoE's dispatch and combine einsums move
    tokens, :mod:`traceroof.routing`): model FLOPs are 6·params·tokens plus attention, the matmuls' work (PaLM,
    Chowdhery et al. 2022, appendix B; How to Scale Your Model §4.2.4, which leaves the parameter update out).
    Rows without ``matmul_flops`` (XProf's exported op stats) or a program without matmuls: the executed FLOPs of
    those rows instead, less random-bit generation as well (:func:`_random_bits`).
    MFU = model FLOPs ÷ step time ÷ peak; HFU = executed FLOPs ÷ step time ÷ peak (How to Scale Your Model
    §4.3.2; ``docs/reference/hardware-and-rooflines.md`` §1). NaN without a peak or a step time.
    """

    flops = counted["flops"].to_numpy(np.float64)
    flops = np.where(np.isnan(flops), 0.0, flops)  # NaN skipped, as pandas' sum
    executed = float(flops.sum()) / per if per else float("nan")
    if model_flops_per_step is not None:
        model = float(model_flops_per_step) / max(program_devices, 1)
        source = (f"given: {fmt_si(float(model_flops_per_step), 'FLOP')} per step over {program_devices} device(s) "
                  "(--model-flops-per-step)")
    else:
        phase = as_text(counted["phase"])
        remat = phase == "remat"
        if "remat" in counted:
            remat |= counted["remat"].fillna(False).to_numpy(bool)
        optimizer = (phase == "optimizer") & ~remat
        matmul = _matmul_flops(counted)
        work = flops if matmul is None else matmul
        parts = [("rematerialised forward", remat), ("optimizer update", optimizer)]
        if matmul is None:  # (random bits hold no matmul)
            parts.append(("random-bit generation (unsigned-integer ops)", _random_bits(counted) & ~remat & ~optimizer))
        left_out = [(w, float(work[rows].sum()) / per if per else 0.0) for w, rows in parts]
        keep = ~np.logical_or.reduce([rows for _, rows in parts])
        routed = 0.0  # one-hot dispatch/combine dots: data movement
        if matmul is not None and "routing_flops" in counted:
            routing = np.nan_to_num(counted["routing_flops"].to_numpy(np.float64)) * keep
            work = work - routing
            routed = float(routing.sum()) / per if per else 0.0
            left_out.append((ROUTING, routed))
        model = float(work[keep].sum()) / per if per else float("nan")
        what = "executed FLOPs" if matmul is None else "the matmuls' FLOPs (dots, convolutions; no elementwise work)"
        less = [f"{fmt_si(v, 'FLOP')} of {w}" for w, v in left_out if v > 0]
        source = f"counted: {what}" + (" less " + " and ".join(less) if less else
                                         ", none left out" if matmul is None else "")
        if routed > 0:
            source += ("; an MoE's expert matmuls count every capacity slot, filled or not: pass "
                       "--model-flops-per-step (6·N_active·T + attention) for the exact MFU")
    if not peak or not step_s or step_s <= 0 or np.isnan(step_s):
        return model, source, float("nan"), float("nan")
    return model, source, model / step_s / peak, executed / step_s / peak


def _matmul_flops(counted: pd.DataFrame) -> np.ndarray | None:
    """The rows' matmul FLOPs (NaN as 0), or None when the rows carry none: no ``matmul_flops`` column (XProf's
    exported op stats), or a program without matmuls, whose model FLOPs are then its executed work."""
    if "matmul_flops" not in counted:
        return None
    matmul = counted["matmul_flops"].to_numpy(np.float64)
    matmul = np.where(np.isnan(matmul), 0.0, matmul)
    return matmul if matmul.any() else None


def _random_bits(counted: pd.DataFrame) -> np.ndarray:
    """Rows that generate random bits (jax.random's threefry hash: unsigned-integer adds, shifts, xors): ops whose
    result is an unsigned integer, and RNG work outside any layer (phase ``other``). They are executed work (HFU)
    but not model FLOPs (the 6·N·T of How to Scale Your Model §4 counts the matmuls' multiply-adds): dropout's
    bits can be a third of a small transformer's counted FLOPs."""
    rng = as_text(counted["phase"]) == "other"
    if "dtype" in counted:
        dtypes = as_text(counted["dtype"])
        unsigned = {t for t in set(dtypes) if isinstance(t, str) and re.fullmatch(r"u\d+", t)}
        rng |= np.array([t in unsigned for t in dtypes], bool)
    return rng


def peak_below_achieved(counted: pd.DataFrame, peak: float | None, peak_key: str, chip_kind: str = "") -> list[str]:
    """A note when a compute-bound op against the ``peak_key`` peak ran at more than ``ABOVE_PEAK_RATIO`` x
    ``peak`` FLOP/s (its FLOPs over its measured time, summed over its executions; ops with at least
    ``SIGNIFICANT_OP_SHARE`` of the op time): no op outruns a true peak, so the peak is low and MFU, HFU and the
    compute roofline overstate utilization by up to that factor. ``counted``: per-op rows with ``flops``,
    ``measured_s``, ``bound``, ``peak_key`` and ``hlo_op``."""
    if not peak or not len(counted) or "bound" not in counted:
        return []
    measured = counted["measured_s"].to_numpy(np.float64)
    flops = counted["flops"].to_numpy(np.float64)
    ok = ((as_text(counted["bound"]) == "compute") & (as_text(counted["peak_key"]) == peak_key)
          & (measured >= SIGNIFICANT_OP_SHARE * np.nansum(measured)) & (measured > 0) & (flops > 0))
    if not ok.any():
        return []
    rate = np.where(ok, flops / np.where(measured > 0, measured, 1.0), 0.0)
    best = int(np.argmax(rate))
    if rate[best] <= ABOVE_PEAK_RATIO * peak:
        return []
    fix = ("re-measure it with `traceroof calibrate` on an idle machine" if chip_kind == "cpu" else
           "check the chip's figures (--chip) and the op's FLOP count")
    over = rate[best] / peak
    return [f"{as_text(counted['hlo_op'])[best]} ran at {fmt_si(float(rate[best]), 'FLOP/s')}, {over:.2g}x the "
            f"{peak_key} peak of {fmt_si(peak, 'FLOP/s')}: {PEAK_TOO_LOW}, so MFU, HFU "
            f"and the compute roofline overstate utilization (by up to {over:.2g}x); {fix}"]


def overlapping_ops_note(op_time_s: float, step_time_s: float) -> list[str]:
    """A note when the op time per step (summed over ops, per device) exceeds the step time by more than
    ``OVERLAP_RATIO``: ops ran at the same time (XLA:CPU's async thunks on several threads, GPU streams), so each
    layer's and op's share of the step is its op time over the step time and the shares add up to more than
    100 %: a share is not the wall time the step would save without it."""
    if not (step_time_s > 0 and op_time_s > OVERLAP_RATIO * step_time_s):
        return []
    return [f"op time per step ({fmt_time(op_time_s)}) is {op_time_s / step_time_s:.0%} of the step time "
            f"({fmt_time(step_time_s)}): ops overlapped (run at the same time on several threads or streams), so "
            "the layers' and ops' shares of the step add up to more than 100 %, and removing an op saves less wall "
            "time than its share"]


def shared_host_note(mfu: float, hfu: float, efficiency: float, devices_per_host: int, chip_kind: str) -> list[str]:
    """A note when several devices of one CPU host (``--xla_force_host_platform_device_count``) are judged against
    the host's calibration: its peak is the whole host's (every core), which the devices share, so per-device MFU,
    HFU and roofline efficiency judge each device against the whole host; the host as a whole ran at
    ``devices_per_host`` times each (the devices' FLOPs and expected times add up on the one host)."""
    if chip_kind != "cpu" or devices_per_host <= 1:
        return []
    k = devices_per_host
    figures = [f"{name} {k * v:.1%}" for name, v in (("MFU", mfu), ("HFU", hfu), ("roofline efficiency", efficiency))
               if v == v]  # (NaN: not computed)
    if not figures:
        return []
    return [f"{k} {SHARED_HOST} (the whole host's cores): MFU, HFU and the "
            f"roofline efficiency above judge each device against the whole host; the host as a whole ran at "
            f"{', '.join(figures)}"]


def utilization_notes(mfu: float, hfu: float, peak: float | None, peak_key: str,
                      roofline_efficiency: float = float("nan")) -> list[str]:
    """Notes on whole-step figures that cannot be right, shown as computed: MFU or HFU outside [0, 1] (more FLOPs
    per second than the peak is impossible: the FLOP count, the step time or the chip's peak is wrong), and a
    roofline efficiency above ``FASTER_THAN_ROOF_RATIO`` (the roofline expects far longer than the step took)."""
    out = []
    odd = [f"{name} {v:.3g}" for name, v in (("MFU", mfu), ("HFU", hfu)) if not np.isnan(v) and not 0 <= v <= 1]
    if odd:
        out.append(f"{' and '.join(odd)} {IMPOSSIBLE} {peak_key} peak ({peak or float('nan'):.3g} "
                   "FLOP/s): impossible, so the FLOP count, the step time or the chip's peak is wrong; check "
                   "--model-flops-per-step, the chip file and the profile's times")
    if roofline_efficiency > FASTER_THAN_ROOF_RATIO:
        out.append(f"roofline efficiency {roofline_efficiency:.3g}: the roofline expects more than "
                   f"{FASTER_THAN_ROOF_RATIO:g}x the measured step time, so the chip's figures understate it or "
                   "the op counts overstate the work (ops counted twice, a step time that is too short)")
    return out
