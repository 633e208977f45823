"""`fleetllm up`: the whole fleet as local processes on one machine.

Pure pieces (what to launch, restart backoff, the status view's content) are kept apart from
the supervisor that starts processes, polls them and feeds the router.
"""
