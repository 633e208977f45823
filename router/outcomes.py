"""What a replica's answer says about the replica, as a pure function of its HTTP status (or of
the `code` of an error event that comes before a stream's first token).

- `ANSWER`: the replica works; the answer goes to the client. Every 1xx-4xx: a 4xx is about the
  request, never held against the replica. (But a 401, which is about the router's engine key,
  never the client's: the proxy backs the replica off and answers 502 before asking here.)
- `UNAVAILABLE`: 502, 503, 504: the replica cannot serve now (its engine is dead, loading,
  draining or overloaded, or a proxy in front of it has lost it). It is backed off, and the
  request moves to another replica while nothing has reached the client. Connection failures
  and timeouts are treated the same way.
- `SUSPECT`: any other 5xx, above all 500. Either the engine broke, or this one request made it
  fail. The replica's /health decides at once: failing, it is backed off; passing, the answer
  was about the request. Either way the answer goes to the client and the request is not
  retried, since a request that broke one engine would otherwise go on to the next.
"""

from __future__ import annotations

import enum


class Verdict(enum.Enum):
    ANSWER = "answer"
    UNAVAILABLE = "unavailable"
    SUSPECT = "suspect"


UNAVAILABLE_STATUSES = frozenset({502, 503, 504})


def classify(status: int) -> Verdict:
    if status in UNAVAILABLE_STATUSES:
        return Verdict.UNAVAILABLE
    if status >= 500:
        return Verdict.SUSPECT
    return Verdict.ANSWER
