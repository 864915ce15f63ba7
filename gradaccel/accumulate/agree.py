"""Ranks agree that they are at the end of the same window before they sum it, or fail saying why.

A window's all-reduce pairs with whatever collective the other ranks call next. When ranks
diverge (one ran a different number of micro-batches, one raised in the middle of a window) the
sum would pair with an unrelated collective: a hang until the process group's timeout, a gloo
size error that says nothing of the cause, or, with equal sizes, a silently wrong gradient.

So before the all-reduce each rank posts "window w, n micro-batches, buffer of m elements" in the
process group's key-value store and waits for every rank's post. The store is not a collective:
it cannot pair with the wrong one. A rank that raises posts its error instead (``abort``), so the
others stop at once with its message; a rank that never posts (killed, hung, or still running
micro-batches) makes the others fail after the store's timeout, which ``init_process_group``
sets to the process group's (Hugging Face's ``TrainingArguments(ddp_timeout=...)``). Cost: one
set, one wait and ``world`` gets per window, on the host, a few hundred microseconds over TCP.
"""

from __future__ import annotations

import collections
import itertools
from datetime import timedelta
from typing import Any

import torch.distributed as dist

# The members of a group build their optimizers on it in the same order: the n-th one's keys are
# the same on every member, and apart from every other optimizer's (of this group or another).
_SERIAL: dict[tuple[int, ...], itertools.count] = collections.defaultdict(itertools.count)


class WindowAgreement:
    """Checks, once per window, that every rank of ``group`` ended the same window alike.

    Args:
        group: the ``torch.distributed`` process group whose ranks sum the window.
        timeout: how long to wait for the other ranks (default: the store's timeout, which is
            the process group's).
    """

    def __init__(self, group: Any, timeout: timedelta | None = None) -> None:
        self.ranks = dist.get_process_group_ranks(group)
        self.rank = dist.get_rank()
        members = tuple(self.ranks)
        self.prefix = f"gradaccel/agree/{'-'.join(map(str, members))}/{next(_SERIAL[members])}/"
        self.window = 0
        self._timeout = timeout
        self._posted = False

    def _store(self):
        return dist.distributed_c10d._get_default_store()

    def _key(self, rank: int, window: int) -> str:
        return f"{self.prefix}{window}/{rank}"

    def timeout(self) -> timedelta:
        return self._timeout if self._timeout is not None else self._store().timeout

    def agree(self, micro_batches: int, numel: int) -> None:
        """Posts this rank's end of window and waits for every rank's; raises if they differ.

        Args:
            micro_batches: micro-batches this rank ran (backward passes) in the window.
            numel: elements of this rank's window buffer.

        Raises:
            RuntimeError: a rank raised (its message), ran another number of micro-batches or
                has another buffer, or did not get here within the timeout.
        """
        store, w = self._store(), self.window
        store.set(self._key(self.rank, w), f"ok {micro_batches} {numel}")
        self._posted = True
        keys = [self._key(r, w) for r in self.ranks]
        timeout = self.timeout()
        try:
            store.wait(keys, timeout)
        except (RuntimeError, dist.DistError) as exc:  # DistStoreError: the timeout
            missing = [r for r, k in zip(self.ranks, keys) if not store.check([k])]
            raise RuntimeError(
                f"gradaccel: rank(s) {missing} did not reach the end of window {w} within "
                f"{timeout.total_seconds():.0f} s, where this rank (rank {self.rank}) ran {micro_batches} "
                "micro-batch(es): they stopped (an error: see their log), hang, or run more micro-batches "
                "per window. Every rank must run the same gradient_accumulation_steps on as many "
                "batches; the timeout is the process group's (TrainingArguments(ddp_timeout=...))") from exc
        posts = {r: store.get(k).decode() for r, k in zip(self.ranks, keys)}
        self.window += 1
        self._posted = False
        if w > 0:
            store.delete_key(self._key(self.rank, w - 1))  # every rank read it before its all-reduce
        failed = {r: p[len("error "):] for r, p in posts.items() if p.startswith("error ")}
        if failed:
            r, msg = next(iter(failed.items()))
            raise RuntimeError(f"gradaccel: rank {r} failed in window {w} ({msg}); rank {self.rank} stops "
                               "too, without summing the window")
        counts = {r: tuple(int(x) for x in p.split()[1:]) for r, p in posts.items()}
        if len({c[0] for c in counts.values()}) > 1:
            per_rank = ", ".join(f"rank {r}: {c[0]}" for r, c in counts.items())
            raise RuntimeError(f"gradaccel: the ranks ran different numbers of micro-batches in window {w} "
                               f"({per_rank}); every rank must use the same gradient_accumulation_steps "
                               "and get as many batches per window")
        if len({c[1] for c in counts.values()}) > 1:
            per_rank = ", ".join(f"rank {r}: {c[1]}" for r, c in counts.items())
            raise RuntimeError(f"gradaccel: the ranks' window buffers differ in size in window {w} "
                               f"({per_rank} elements); every rank must train the same parameters")

    def abort(self, exc: BaseException) -> None:
        """Posts this rank's error for the current window, so the other ranks stop at once."""
        if self._posted:
            return  # already posted this window: the others read that
        try:
            msg = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]
            self._store().set(self._key(self.rank, self.window), f"error {msg}")
            self._posted = True
        except Exception:  # the store is gone too: the others time out instead
            pass
