"""One collective per chunk, in chunk order, each after its chunk's counter is reached.

Buffers (``plan`` names the layout, see ``overlap.plan``):

===================  ===========================  =========================================
collective           GEMM writes (``p_flat``)     each chunk's result goes to
===================  ===========================  =========================================
all_reduce           ``out`` itself (row bands)   in place
                     or a slot buffer (columns)   in place, then copied into ``out``
reduce_scatter       slot buffer ``[M * N]``      ``out[M / R, N]`` rows of the chunk
                                                  (through ``recv_flat`` for column bands)
all_to_all           slot buffer ``[M * N]``      ``out[M, N]`` viewed ``[R, M / R, N]``
                                                  (through ``recv_flat`` for column bands)
===================  ===========================  =========================================

Everything here runs on the current stream (the communication stream), in issue order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..plan import Plan


def run_chunks(
    plan: Plan,
    comm,
    p_flat: torch.Tensor,
    out: torch.Tensor,
    recv_flat: torch.Tensor | None,
    wait: Callable[[int], None],
) -> None:
    """Issue the collective of every chunk of ``plan`` on the current stream.

    Args:
        plan: the overlap plan.
        comm: a communicator from ``overlap.comm.make_comm``.
        p_flat: ``[M * N]`` the GEMM's slot buffer (a view of ``out`` for row-band all-reduce).
        out: the result, standard layout: ``[M, N]`` (all-reduce, all-to-all) or
            ``[M / R, N]`` (reduce-scatter).
        recv_flat: receive slots for column-band reduce-scatter (``[M / R * N]``) and
            all-to-all (``[M * N]``); ``None`` otherwise.
        wait: ``wait(c)`` orders what follows after chunk ``c``'s tiles are stored.
    """
    R, N = plan.world_size, plan.N
    in_place = plan.n_col_bands == 1  # results land directly in `out`
    for c in range(plan.n_chunks):
        off, rows, cols, row0, col0 = plan.chunk_slot(c)
        slot = p_flat[off : off + rows * cols]
        wait(c)
        if plan.collective == "all_reduce":
            comm.all_reduce(slot)
            if not in_place:
                out[row0 : row0 + rows, col0 : col0 + cols].copy_(slot.view(rows, cols))
            continue
        h_a = rows // R  # rows of each rank's block in this chunk
        r0 = row0 // R  # first of them, within the rank's block
        if plan.collective == "reduce_scatter":
            if in_place:
                comm.reduce_scatter(out[r0 : r0 + h_a].view(-1), slot)
            else:
                recv = recv_flat[off // R : off // R + h_a * cols]
                comm.reduce_scatter(recv, slot)
                out[r0 : r0 + h_a, col0 : col0 + cols].copy_(recv.view(h_a, cols))
        else:  # all_to_all
            out3 = out.view(R, -1, N)
            if in_place:
                comm.all_to_all(
                    [out3[s, r0 : r0 + h_a].view(-1) for s in range(R)], list(slot.chunk(R))
                )
            else:
                recv = recv_flat[off : off + rows * cols]
                comm.all_to_all(list(recv.chunk(R)), list(slot.chunk(R)))
                out3[:, r0 : r0 + h_a, col0 : col0 + cols].copy_(recv.view(R, h_a, cols))
