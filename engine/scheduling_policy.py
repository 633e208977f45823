"""Which waiting request a step admits first: the policies `--scheduling-policy` names.

`fcfs` admits in arrival order. `shortest-first` orders waiting requests by the step they
arrived at plus the steps their prefill alone would take (tokens over the step's token budget).
Requests that arrived together go shortest prompt first, which lowers their mean time to first
token without moving the last one: the same work is done, in another order. A long prompt is
overtaken only by requests that arrive within its own prefill time after it, so none starves.

Kept apart from the scheduler so that the command line can name the choices without loading
torch.
"""

from __future__ import annotations

SHORTEST_FIRST = "shortest-first"
FCFS = "fcfs"
POLICIES = (SHORTEST_FIRST, FCFS)
DEFAULT_POLICY = SHORTEST_FIRST


def shortest_first_key(arrival_step: int, num_tokens: int, max_num_batched_tokens: int) -> float:
    """The step by which a request's prefill would be done were it alone."""
    return arrival_step + num_tokens / max_num_batched_tokens
