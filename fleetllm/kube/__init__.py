"""The one Kubernetes access layer of fleetllm: login, reads, writes and watches.

The operator, the router and the autoscaler all talk to the API server through
`client.KubeClient`: async calls on one aiohttp session, errors as `errors.ApiError`.

- `login`: credentials through the `kubernetes` package's loaders (service account, kubeconfig,
  exec plugins), and when to load them again;
- `session`: the one HTTP session, logged in, that answers a request or raises;
- `client`: `KubeClient`, the verbs (get, list, apply, patch, scale, delete, watch, follow);
- `watch`: what watches yield, and the backoff between failed ones;
- `resources`: `Resource` (where a kind's URLs live) and the kinds fleetllm uses;
- `errors`: `ApiError`, the API server's error answers;
- `events`: core/v1 Events as `kubectl describe` shows them.
"""
