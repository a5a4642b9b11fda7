"""Matmuls that route data by a one-hot mask: a mixture-of-experts layer written as einsums (GShard, Lepikhin et
al. 2020 §2.2; Switch Transformer, Fedus et al. 2022, whose ``dispatch_tensor`` [tokens, experts, capacity] is
one-hot) moves each token to its expert's capacity slot, and back, with dots whose other operand is the mask
(``einsum("tec,td->ecd", dispatch, x)``), and the backward pass adds the dots of the transposed mask and the one
whose result only the mask selects from (the gate's gradient). They are executed work (HFU) but no model FLOPs:
6·N·T counts the multiply-adds of the parameters with the tokens (PaLM, Chowdhery et al. 2022, appendix B), and
a one-hot matmul is a gather or a scatter done on a matrix unit (one-hot embedding lookups and one-hot label
selections too).

A value is a one-hot mask when it comes from an equality compare with an ``iota`` (``jax.nn.one_hot``: ``x[...,
None] == arange(n)``), followed through converts, layout ops, fusion boundaries, selects that keep or zero it and
multiplications (a mask times anything has one nonzero per row at most: the combine's ``dispatch * gate``).
"""

from __future__ import annotations

from typing import Mapping

from parsers.hlo import Computation, HloModule, Instruction

LAYOUT = frozenset({"bitcast", "reshape", "broadcast", "transpose", "copy", "slice", "convert"})
MAX_DEPTH = 24  # instructions followed from one operand (one-hot masks are built a few ops before their dot)


class OneHotMasks:
    """Which dots of ``module`` route by a one-hot mask (:meth:`is_routing_dot`), answers cached per value."""

    def __init__(self, module: HloModule, where: Mapping[str, Computation], caller: Mapping[str, Instruction]
                 ) -> None:
        """``where``: instruction name -> its computation; ``caller``: fused computation -> its fusion instruction
        (:class:`traceroof.cost.CostModel`'s ``comp_of`` and ``caller``, built once per module)."""
        self.module = module
        self._where, self._caller = where, caller
        # answers by value name; one reached first beyond MAX_DEPTH stays "no" (masks are built near their dots)
        self._mask: dict[str, bool] = {}
        self._iota: dict[str, bool] = {}

    def is_routing_dot(self, dot: Instruction) -> bool:
        """True for a ``dot`` with a one-hot mask as an operand, or whose result (through layout ops) is only
        multiplied by one (the backward pass's gradient of the mask, which the mask then selects from)."""
        if dot.opcode != "dot":
            return False
        comp = self._where.get(dot.name)
        if comp is None:
            return False
        if any(self._operand_is(self._is_mask, comp, dot, i, 0) for i in range(min(len(dot.operands), 2))):
            return True
        return self._masked_result(comp, dot, 0)

    # -- one value --------------------------------------------------------------------------------------------
    def _operand_is(self, test, comp: Computation, inst: Instruction, i: int, depth: int) -> bool:
        """``test`` of operand ``i`` of ``inst`` (an instruction of ``comp``)."""
        src = comp.by_name.get(inst.operands[i]) if 0 <= i < len(inst.operands) else None
        return src is not None and test(comp, src, depth + 1)

    def _through(self, test, comp: Computation, inst: Instruction, depth: int) -> bool | None:
        """``test`` across a fusion boundary: a fusion's root, a fused parameter's argument, a multi-output
        fusion's element; ``None`` for any other instruction."""
        op = inst.opcode
        if op == "fusion":
            called = self.module.computations.get(inst.called[0]) if inst.called else None
            return called is not None and called.root is not None and test(called, called.root, depth + 1)
        if op == "parameter":
            fusion = self._caller.get(comp.name)
            outer = self._where.get(fusion.name) if fusion is not None else None
            return outer is not None and self._operand_is(test, outer, fusion, inst.parameter_number, depth)
        if op == "get-tuple-element":
            src = comp.by_name.get(inst.operands[0]) if inst.operands else None
            called = self.module.computations.get(src.called[0]) if src is not None and src.opcode == "fusion" \
                and src.called else None
            root = called.root if called is not None else None
            index = inst.tuple_index
            return root is not None and root.opcode == "tuple" and 0 <= index < len(root.operands) \
                and self._operand_is(test, called, root, index, depth)
        return None

    def _is_mask(self, comp: Computation, inst: Instruction, depth: int) -> bool:
        key = inst.name
        if key not in self._mask:
            self._mask[key] = False  # (a cycle, or too deep: not a mask)
            self._mask[key] = depth <= MAX_DEPTH and self._mask_of(comp, inst, depth)
        return self._mask[key]

    def _mask_of(self, comp: Computation, inst: Instruction, depth: int) -> bool:
        op = inst.opcode
        if op == "compare":
            return inst.attrs.get("direction") == "EQ" and any(
                self._operand_is(self._is_iota, comp, inst, i, depth) for i in range(2))
        if op in LAYOUT:
            return self._operand_is(self._is_mask, comp, inst, 0, depth)
        if op in ("multiply", "and"):
            return any(self._operand_is(self._is_mask, comp, inst, i, depth) for i in range(2))
        if op == "select":  # keeps a mask or zeroes it: select(keep, mask, 0)
            return all(self._operand_is(self._is_mask, comp, inst, i, depth)
                       or self._operand_is(self._is_zero, comp, inst, i, depth) for i in (1, 2)) and any(
                self._operand_is(self._is_mask, comp, inst, i, depth) for i in (1, 2))
        got = self._through(self._is_mask, comp, inst, depth)
        return bool(got)

    def _is_iota(self, comp: Computation, inst: Instruction, depth: int) -> bool:
        key = inst.name
        if key not in self._iota:
            self._iota[key] = False
            self._iota[key] = depth <= MAX_DEPTH and self._iota_of(comp, inst, depth)
        return self._iota[key]

    def _iota_of(self, comp: Computation, inst: Instruction, depth: int) -> bool:
        op = inst.opcode
        if op == "iota":
            return True
        if op in LAYOUT:
            return self._operand_is(self._is_iota, comp, inst, 0, depth)
        if op in ("add", "subtract"):  # arange(n) + offset (a device's slice of the experts)
            return any(self._operand_is(self._is_iota, comp, inst, i, depth) for i in range(2))
        return bool(self._through(self._is_iota, comp, inst, depth))

    def _is_zero(self, comp: Computation, inst: Instruction, depth: int) -> bool:
        if inst.opcode == "constant":
            return inst.literal.strip() in ("0", "-0", "0.0", "false")
        if inst.opcode in ("broadcast", "bitcast", "reshape", "convert") and depth <= MAX_DEPTH:
            return self._operand_is(self._is_zero, comp, inst, 0, depth)
        return bool(depth <= MAX_DEPTH and self._through(self._is_zero, comp, inst, depth))

    def _masked_result(self, comp: Computation, inst: Instruction, depth: int) -> bool:
        """Every use of ``inst``'s value (through layout ops, and out of a fusion whose root it is) multiplies
        it by a one-hot mask."""
        if depth > MAX_DEPTH:
            return False
        users = comp.users().get(inst.name, [])
        if not users:
            fusion = self._caller.get(comp.name) if inst is comp.root else None
            outer = self._where.get(fusion.name) if fusion is not None else None
            return outer is not None and self._masked_result(outer, fusion, depth + 1)
        for u in users:
            if u.opcode in ("bitcast", "reshape", "transpose", "copy"):
                if not self._masked_result(comp, u, depth + 1):
                    return False
            elif u.opcode == "multiply":
                other = [i for i, name in enumerate(u.operands[:2]) if name != inst.name]
                if not other or not self._operand_is(self._is_mask, comp, u, other[0], depth):
                    return False
            else:
                return False
        return True
