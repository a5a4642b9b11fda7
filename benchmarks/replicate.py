"""Build a large ``.xplane.pb`` by replicating a fixture's op events (the benchmark input).

Usage::

    python benchmarks/replicate.py [--events 5000000] [--fixture transformer] [--one-line-per-thread]
                                   [-o benchmarks/data/big.xplane.pb]

Every line of ``/host:CPU`` (runtime threads with the op events, async ``end:`` events and launches; the
``python`` line's step annotations) is copied K times, each copy on its own line id with its ``timestamp_ns``
shifted past the previous copy, ``step_num`` renumbered and the execution and flow ids (``run_id``, ``_p``,
``_c``) offset so each copy is executions of its own, so the result is a valid profile of K x the original
steps that ``traceroof analyze`` reads like any other. With ``--one-line-per-thread`` the copies' events are appended
to the original lines instead (their offsets shifted), as a long capture records them: a few threads with millions of
events each, where the default gives thousands of small lines. The HLO dumps of the fixture still apply (same
program ids). Output goes to ``benchmarks/data/`` (git-ignored): regenerate it, never commit it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(num: int, payload: bytes) -> bytes:
    return _varint((num << 3) | 2) + _varint(len(payload)) + payload


def replicate(src: Path, dst: Path, target_events: int, one_line_per_thread: bool = False) -> tuple[int, int]:
    """Write the replicated profile; returns (op events written, copies). ``one_line_per_thread``: each line's
    copies go on the line itself (offsets shifted by the copy's time shift), not on lines of their own."""
    from parsers.xspace import SCHEMA, scanner

    _wirescan = scanner()[1]
    data = src.read_bytes()
    XP, XL = SCHEMA["XPlane"], SCHEMA["XLine"]
    top = _wirescan.scan_fields(data, 0, len(data))
    out = bytearray()
    written = copies = 0
    for f, _, t, s, e, _ in top:
        if f != 1:
            out += data[t:e]
            continue
        fields = _wirescan.scan_fields(data, s, e)
        hdr = XP()
        hdr.ParseFromString(b"".join(data[ft:fe] for ff, _, ft, _, fe, _ in fields if ff != 3))
        if hdr.name != "/host:CPU":
            out += data[t:e]
            continue
        stat_id = {v.name: k for k, v in hdr.stat_metadata.items()}
        lines = [(fs, fe) for ff, _, _, fs, fe, _ in fields if ff == 3]
        op_lines, other = [], []
        for fs, fe in lines:
            lf = _wirescan.scan_fields(data, fs, fe)
            xl = XL()
            xl.ParseFromString(data[fs:fe])
            (other if xl.name == "python" else op_lines).append((xl, lf, fs, fe))
        per_copy = sum(len(xl.events) for xl, _, _, _ in op_lines)
        copies = max(1, -(-target_events // max(per_copy, 1)))
        end_ns = max((xl.timestamp_ns + max((ev.offset_ps + ev.duration_ps for ev in xl.events), default=0) // 1000
                      for xl, _, _, _ in op_lines + other), default=0)
        shift_ns = end_ns + 1000
        steps_per_copy = 1 + max((int(st.int64_value or st.uint64_value) for xl, _, _, _ in other
                                  for ev in xl.events for st in ev.stats
                                  if st.metadata_id == stat_id.get("step_num")), default=-1)
        plane = bytearray(b"".join(data[ft:fe] for ff, _, ft, _, fe, _ in fields if ff != 3))
        # ids that name one execution or one flow (run_id; the _p/_c producer/consumer ids tying launches to
        # ops) are offset per copy, so every copy is its own executions, as successive steps of a real run are
        ids = {stat_id[n] for n in ("run_id", "_p", "_c") if n in stat_id}
        values: dict[int, list[int]] = {i: [] for i in ids}
        for xl, _, _, _ in op_lines + other:
            for ev in xl.events:
                for st in ev.stats:
                    if st.metadata_id in ids:
                        values[st.metadata_id].append(int(st.int64_value or st.uint64_value))
        # run ids are a launch counter (consecutive per program): copy k continues it
        id_span = {i: 1 + max(v) - min(v) if v else 0 for i, v in values.items()}

        def renumber(events: object, k: int) -> None:
            """Copy ``k``'s step numbers and execution / flow ids (in place)."""
            for ev in events:
                for st in ev.stats:
                    if st.metadata_id == stat_id.get("step_num"):
                        st.int64_value = int(st.int64_value or st.uint64_value) + k * steps_per_copy
                    elif st.metadata_id in ids:
                        value = int(st.int64_value or st.uint64_value) + k * id_span[st.metadata_id]
                        if st.HasField("uint64_value"):
                            st.uint64_value = value
                        else:
                            st.int64_value = value

        if one_line_per_thread:
            for xl, _, _, _ in op_lines + other:
                merged = XL()
                merged.CopyFrom(xl)
                for k in range(1, copies):
                    shifted = XL()
                    shifted.events.extend(xl.events)
                    for ev in shifted.events:
                        ev.offset_ps += k * shift_ns * 1000
                    renumber(shifted.events, k)
                    merged.events.extend(shifted.events)
                plane += _field(3, merged.SerializeToString())
                if xl.name != "python":
                    written += len(merged.events)
        else:
            for k in range(copies):
                for xl, _, _, _ in op_lines + other:
                    copy = XL()
                    copy.CopyFrom(xl)
                    copy.id = xl.id + k * 1_000_003 if k else xl.id
                    copy.timestamp_ns = xl.timestamp_ns + k * shift_ns
                    if k:
                        renumber(copy.events, k)
                    plane += _field(3, copy.SerializeToString())
                    if xl.name != "python":
                        written += len(xl.events)
        out += _field(1, bytes(plane))
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(bytes(out))
    return written, copies


def main(argv: list[str] | None = None) -> None:
    """Parse arguments and write the replicated profile."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=5_000_000)
    ap.add_argument("--fixture", default="transformer")
    ap.add_argument("--one-line-per-thread", action="store_true",
                    help="append the copies to the original lines (a few lines of millions of events)")
    ap.add_argument("-o", "--output", default=None)
    args = ap.parse_args(argv)
    src = next((ROOT / "fixtures" / args.fixture / "logdir").rglob("*.xplane.pb"))
    dst = Path(args.output or ROOT / "benchmarks" / "data" / f"{args.fixture}_x{args.events}" /
               "plugins" / "profile" / "run" / "host.xplane.pb")
    written, copies = replicate(src, dst, args.events, args.one_line_per_thread)
    print(f"{dst}: {written:,} op-line events ({copies} copies), {dst.stat().st_size:,} bytes")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
