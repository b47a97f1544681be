"""Receiving a point-to-point message without a busy wait.

A blocking ``comm.recv`` in MPICH (and in most MPIs on shared memory) spins in the
progress engine until the message comes: a rank that waits most of the time (a
hierarchical job's group PS between requests, a trainer waiting on a PS's reply, the
EASGD centre between exchanges) then takes a whole core from the ranks that compute
beside it. :func:`recv` polls instead, with a matched probe (``improbe``: the probed
message is the one received, even when other threads of the process receive on the
same communicator), and sleeps between probes: the first pause is short, so that a
reply that comes at once costs little latency, and the pauses double up to
``LONGEST_PAUSE`` while nothing comes, which bounds the extra latency of a message
that ends a long idle spell and keeps an idle rank's CPU to a few percent of a core.
Each call starts again from ``FIRST_PAUSE``. :func:`wait` does the same for a
non-blocking operation's request (an ``Iallreduce``, an ``Ibcast``): a collective
that may wait on a peer then waits by the clock, with a timeout, rather than in a
blocking call that never returns when the peer has died or hung. It first tests
back to back for ``YIELD_FOR`` (yielding the core between tests, as a blocking
collective waits), then in bursts of ``BURST`` before each pause, since a collective
advances only while its ranks call into MPI.

MPICH has switches that bear on this (``MPIR_CVAR_CH4_PROGRESS_THROTTLE`` sleeps
1 us after thousands of empty polls; ``MPIR_CVAR_POLLS_BEFORE_YIELD`` calls
sched_yield, which still counts as CPU) but none that makes a blocking receive sleep,
and they are MPICH's own; this works under any MPI-3 library.

Thread safety: as the communicator's (MPI_THREAD_MULTIPLE for concurrent callers).
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional

__all__ = ["recv", "wait", "FIRST_PAUSE", "LONGEST_PAUSE", "BURST", "YIELD_FOR"]

FIRST_PAUSE = 20e-6    # seconds slept after the first empty probe
LONGEST_PAUSE = 1e-3   # the pauses double up to this while no message comes
BURST = 50e-6          # seconds wait() tests back to back before each pause
YIELD_FOR = 20e-3      # seconds wait() first tests back to back, yielding the core between tests


def recv(comm, source: int, tag: int, *, timeout: Optional[float] = None,
         expired: Optional[Callable[[], BaseException]] = None, status=None):
    """``comm.recv(source=source, tag=tag, status=status)`` (wildcards allowed), the
    wait spent sleeping between probes rather than spinning.

    timeout: seconds; when no matching message has come by then, raises
    ``expired()`` (an exception built when it is raised, so it can say what was
    still awaited), or TimeoutError without `expired`. None waits for ever."""
    message = _poll(lambda: comm.improbe(source=source, tag=tag, status=status), timeout, expired,
                    lambda: f"no message from rank {source} with tag {tag} within {timeout:g} s")
    return message.recv()


def wait(request, *, timeout: Optional[float] = None, expired: Optional[Callable[[], BaseException]] = None) -> None:
    """``request.Wait()`` (an MPI request, e.g. ``comm.Iallreduce``'s, or a list of
    them: ``MPI.Request.Waitall``): tested back to back, yielding the core, for
    YIELD_FOR, then in bursts between sleeps rather than spinning.

    timeout: seconds; when the operation has not completed by then, raises
    ``expired()`` (TimeoutError without it). The operation is then still in flight
    (MPI cannot cancel a collective, and its buffer may still be written): the
    caller ends the job rather than go on. None waits for ever."""
    requests = request if isinstance(request, (list, tuple)) else [request]
    # First, tests back to back with the core yielded between them, as a blocking
    # collective waits: a rank asleep in a pause stalls every round of a collective
    # that needs it, and with the peers there (a group's gradients each step) pauses
    # of up to 1 ms slowed a group of four trainers sharing two cores to about 0.6x
    # (W10 line 7). Past YIELD_FOR a peer is late, not descheduled: the bursts and
    # pauses below, which leave the core to the ranks that compute.
    start = time.monotonic()
    end = start + (YIELD_FOR if timeout is None else min(YIELD_FOR, timeout))
    while not all(r.Test() for r in requests):
        if time.monotonic() > end:
            break
        os.sched_yield()
    else:
        return

    def done() -> Optional[bool]:
        # A collective advances only while its ranks call into MPI, and one of several
        # rounds (a large all-reduce goes in pieces) completes a round a test: tested
        # once a pause, 128 KiB all-reduced by two ranks took 12 ms instead of 1. A
        # burst of tests lets it run its rounds back to back once the peers are there.
        # (A completed request's Test is True again: it became MPI_REQUEST_NULL.)
        end = time.monotonic() + BURST
        while not all(r.Test() for r in requests):
            if time.monotonic() > end:
                return None
        return True
    rest = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
    _poll(done, rest, expired, lambda: f"an MPI operation did not complete within {timeout:g} s")


def _poll(ready: Callable[[], Any], timeout: Optional[float], expired: Optional[Callable[[], BaseException]],
          late: Callable[[], str]) -> Any:
    """ready()'s first result that is not None, polled with pauses that double from
    FIRST_PAUSE to LONGEST_PAUSE; past `timeout`, raises expired() or TimeoutError(late())."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = FIRST_PAUSE
    while True:
        got = ready()
        if got is not None:
            return got
        if deadline is not None and time.monotonic() > deadline:
            if expired is not None:
                raise expired()
            raise TimeoutError(late())
        time.sleep(pause)
        pause = min(pause * 2, LONGEST_PAUSE)
