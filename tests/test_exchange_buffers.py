"""What the exchanger requires of the buffers it moves, at 2 ranks on gloo (csrc/comm/exchanger.cpp check_plain,
csrc/comm/in_flight_buffers.h).

Every transport moves a buffer's raw memory, so a tensor whose values are not its memory is refused before anything
is posted: a conjugate view (z.conj()) was sent as z, a negated view (z.conj().imag) as its values without their
sign, and a conjugate recv read back conjugated. And the memory of a transfer in flight stays the transfer's until
wait(): resize_ of a send or recv in flight freed the memory gloo was still reading (the peer received garbage) or
writing (the received data vanished), and set_ of a recv made the rank die with SIGSEGV.
"""
import time

import numpy as np
import torch
import torch.distributed as dist

from decent_comm.exchange import Exchanger

from exchange_support import Suite, errors

N = 1 << 20  # 4 MB of float32: large enough that a freed buffer goes back to the system (munmap)
DELAY_S = 1.0  # rank 1 posts this late, so rank 0's transfers are still in flight when it edits its buffers


def _value(rank):
    """What `rank` sends in the in-flight scenarios: rank + 1 everywhere."""
    return torch.full((N,), rank + 1.0)


def _refusals(rank, world_size):
    p = [1 - rank]
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    x = torch.tensor([1.0, 2.0])
    out = {}
    with Exchanger(timeout=20) as ex, Exchanger(timeout=20, wire_dtype=torch.bfloat16) as exw:
        cases = {  # every rank makes the same refused calls: neither is left waiting for the other
            "send conj": lambda: ex.exchange(1, z.conj(), [torch.empty(2, dtype=torch.complex64)], p, p),
            "send neg": lambda: ex.exchange(2, z.conj().imag, [torch.empty(2)], p, p),
            "send neg private": lambda: ex.exchange(2, torch._neg_view(x), [torch.empty(2)], p, p),
            "recv conj": lambda: ex.exchange(3, z, [torch.empty(2, dtype=torch.complex64).conj()], p, p),
            "recv neg": lambda: ex.exchange(4, x, [torch.zeros(2, dtype=torch.complex64).conj().imag], p, p),
            "send sparse": lambda: ex.exchange(5, x.to_sparse(), [torch.empty(2)], p, p),
            "recv sparse": lambda: ex.exchange(5, x, [torch.zeros(2).to_sparse()], p, p),
            # The bf16 wire's cast would resolve the bit, but a buffer already in the wire dtype goes as is: refused
            # alike, whatever the dtypes.
            "wire send neg": lambda: exw.exchange(6, z.conj().imag, [torch.empty(2, dtype=torch.bfloat16)], p, p),
        }
        for name, fn in cases.items():
            out[name] = errors(fn)
        out["in flight after"] = (ex.in_flight, exw.in_flight)
        # The same bucket ids, right after: usable, and what arrives is what the sender's tensor reads as.
        got = [torch.empty(2, dtype=torch.complex64), torch.empty(2), torch.empty(2, dtype=torch.complex64)]
        ex.exchange(1, z.conj().resolve_conj(), [got[0]], p, p)
        ex.exchange(2, z.conj().imag.resolve_neg(), [got[1]], p, p)
        ex.exchange(3, z, [got[2]], p, p)
        ex.wait_all()
        out["got"] = got
    # Asymmetric: rank 0 is refused, then retries at once; rank 1 exchanges once. Nothing of the refused call was
    # posted, so rank 1's receive meets the retry (on the old code it met the refused call's raw memory).
    with Exchanger(timeout=20) as ex:
        recv = torch.empty(2, dtype=torch.complex64)
        if rank == 0:
            out["refused"] = errors(lambda: ex.exchange(7, z.conj(), [recv], p, p))
        ex.exchange(7, z.conj().resolve_conj() if rank == 0 else z, [recv], p, p)
        ex.wait(7)
        out["retry got"] = recv
    dist.barrier()
    return out


def test_conjugate_negative_and_sparse_buffers_are_refused_before_anything_is_posted():
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    for rank, out in enumerate(SUITE.part(2, "refusals")):
        for case, parts in {
            "send conj": ["bucket=1", "send has its conjugate bit set", "resolve_conj()"],
            "send neg": ["bucket=2", "send has its negative bit set", "resolve_neg()"],
            "send neg private": ["bucket=2", "send has its negative bit set", "resolve_neg()"],
            "recv conj": ["bucket=3", f"recvs[0] (from rank {1 - rank}) has its conjugate bit", "resolve_conj()"],
            "recv neg": ["bucket=4", f"recvs[0] (from rank {1 - rank}) has its negative bit", "resolve_neg()"],
            "send sparse": ["bucket=5", "send has layout Sparse", "dense", "to_dense()"],
            "recv sparse": ["bucket=5", "recvs[0]", "layout Sparse", "dense"],
            "wire send neg": ["bucket=6", "send has its negative bit set"],
        }.items():
            kind, msg = out[case]
            assert kind == "ValueError", (rank, case, kind, msg)
            for text in parts:
                assert text in msg, (rank, case, text, msg)
            assert "contiguous" not in msg, (rank, case, msg)
        assert out["in flight after"] == ([], [])
        conj_got, neg_got, plain_got = out["got"]
        assert torch.equal(conj_got, torch.tensor([1 - 2j, 3 + 4j], dtype=torch.complex64))
        assert torch.equal(neg_got, torch.tensor([-2.0, 4.0]))  # -imag(z)
        assert torch.equal(plain_got, z)
    res = SUITE.part(2, "refusals")
    assert res[0]["refused"][0] == "ValueError" and "conjugate bit" in res[0]["refused"][1]
    assert torch.equal(res[1]["retry got"], torch.tensor([1 - 2j, 3 + 4j], dtype=torch.complex64))
    assert torch.equal(res[0]["retry got"], z)


def _edit_in_flight(ex, rank, edit):
    """Rank 0 exchanges bucket 0 with rank 1 (which posts DELAY_S late) and applies `edit(send, recv)` while it is in
    flight; then both wait. Returns what the edit and the wait raised and whether each buffer still holds its
    expected values (for rank 1: rank 0's send as it was at exchange())."""
    p = [1 - rank]
    send, recv = _value(rank), torch.zeros(N)
    dist.barrier()
    if rank == 1:
        time.sleep(DELAY_S)
    ex.exchange(0, send, [recv], p, p)
    edited = errors(lambda: edit(send, recv)) if rank == 0 else ("none", "")
    if rank == 0:
        # Allocations that would reuse memory freed under the transfer, and writes into them.
        junk = [torch.full((N,), -3.0) for _ in range(4)]  # noqa: F841
    waited = errors(lambda: ex.wait(0))
    return dict(edited=edited, waited=waited, in_flight=ex.in_flight, shapes=(list(send.shape), list(recv.shape)),
                recv_ok=recv.numel() == N and torch.equal(recv, _value(1 - rank)),
                send_resizable=send.untyped_storage().resizable(), recv_resizable=recv.untyped_storage().resizable())


def _in_flight(rank, world_size):
    p = [1 - rank]
    out = {}
    with Exchanger(timeout=20) as ex:
        ex.exchange(0, _value(rank), [torch.empty(N)], p, p)  # agreed: later exchanges post at once, no handshake
        ex.wait(0)
        edits = {
            "grow send": lambda s, r: s.resize_(4 * N),
            "grow recv": lambda s, r: r.resize_(4 * N),
            "free recv storage": lambda s, r: r.untyped_storage().resize_(0),
            "shrink recv": lambda s, r: r.resize_(N // 2),
            "set recv": lambda s, r: r.set_(torch.zeros(N)),
            "set send": lambda s, r: s.set_(torch.zeros(N)),
            "data send": lambda s, r: setattr(s, "data", torch.zeros(N)),
        }
        for name, edit in edits.items():
            out[name] = _edit_in_flight(ex, rank, edit)
        # Still usable after every case: a plain exchange delivers exact data.
        recv = torch.empty(N)
        ex.exchange(0, _value(rank), [recv], p, p)
        ex.wait(0)
        out["after"] = torch.equal(recv, _value(1 - rank))

        # Buffers of two buckets in one flat storage: it stays pinned until the last of them was waited for, and
        # then gets its own flag back; a storage that was never resizable (numpy's) stays so.
        flat = torch.zeros(2 * N)
        ex.exchange(1, _value(rank), [flat[:N]], p, p)
        ex.exchange(2, _value(rank), [flat[N:]], p, p)
        ex.wait(1)
        out["shared, one waited"] = errors(lambda: flat.untyped_storage().resize_(4 * 4 * N))
        ex.wait(2)
        out["shared, both waited"] = flat.untyped_storage().resizable()
        out["shared data"] = torch.equal(flat, torch.full((2 * N,), 2.0 - rank))
        array = torch.from_numpy(np.zeros(N, dtype=np.float32))
        before = array.untyped_storage().resizable()
        ex.exchange(1, _value(rank), [array], p, p)
        ex.wait(1)
        out["numpy"] = (before, array.untyped_storage().resizable(), torch.equal(array, _value(1 - rank)))
    dist.barrier()
    return out


def test_buffers_resized_or_repointed_in_flight_keep_the_transfer_memory_and_raise():
    res = SUITE.part(2, "in_flight")
    mine, peer = res  # rank 0 edits, rank 1 only exchanges
    for case in ["grow send", "grow recv", "free recv storage", "shrink recv", "set recv", "set send", "data send"]:
        # The peer always received rank 0's send as it was at exchange(): its memory stayed the transfer's.
        assert peer[case]["waited"] == ("none", "") and peer[case]["recv_ok"], (case, peer[case])
        for out in res:
            assert out[case]["in_flight"] == [], (case, out[case])
            assert out[case]["send_resizable"] and out[case]["recv_resizable"], (case, out[case])  # flags back
    # A resize that would reallocate is refused where it is made, and the transfer completes untouched.
    kind, msg = mine["free recv storage"]["edited"]
    assert kind == "RuntimeError" and "not resizable" in msg, msg
    assert mine["free recv storage"]["waited"] == ("none", "") and mine["free recv storage"]["recv_ok"]
    # torch's refused Tensor.resize_ has already given the tensor its new shape, past its memory: wait() sets the shape
    # back, so the recv holds the data received, and raises naming the bucket and the buffer.
    for case, buffer in {"grow send": "send", "grow recv": "recvs[0] (from rank 1)"}.items():
        kind, msg = mine[case]["edited"]
        assert kind == "RuntimeError" and "not resizable" in msg, (case, kind, msg)
        kind, msg = mine[case]["waited"]
        assert kind == "RuntimeError", (case, kind, msg)
        for text in ["Exchanger.wait(bucket=0)", buffer, "was resized while bucket 0 was in flight",
                     "torch refused the resize_", f"Its shape is set back to [{N}]"]:
            assert text in msg, (case, text, msg)
        assert mine[case]["shapes"] == ([N], [N]) and mine[case]["recv_ok"], (case, mine[case])
    # One that needs no new memory, or another storage, is allowed by torch; wait() raises naming the bucket and the
    # buffer, and says where the data went.
    for case, (buffer, where) in {
        "shrink recv": ("recvs[0] (from rank 1)", "received from rank 1 went into the memory it had at exchange()"),
        "set recv": ("recvs[0] (from rank 1)", "received from rank 1 went into the memory it had at exchange()"),
        "set send": ("send", "peers received what its former memory held"),
        "data send": ("send", "peers received what its former memory held"),
    }.items():
        assert mine[case]["edited"] == ("none", ""), (case, mine[case])
        kind, msg = mine[case]["waited"]
        assert kind == "RuntimeError", (case, kind, msg)
        for text in ["Exchanger.wait(bucket=0)", buffer, "resized or re-pointed", "while bucket 0 was in flight",
                     where]:
            assert text in msg, (case, text, msg)
    assert mine["set send"]["recv_ok"] and mine["data send"]["recv_ok"]
    for out in res:
        assert out["after"]
        assert out["shared, one waited"][0] == "RuntimeError" and "not resizable" in out["shared, one waited"][1]
        assert out["shared, both waited"] and out["shared data"]
        assert out["numpy"] == (False, False, True)


SUITE = Suite({2: [("refusals", _refusals, ()), ("in_flight", _in_flight, ())]})
