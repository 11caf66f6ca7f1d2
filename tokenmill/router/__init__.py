"""Router: one OpenAI-compatible front over several `tokenmill serve` replicas (routing only; the replicas it
launches itself, and the `tokenmill router` command, are fleet/).

app.py: the router's app (/health, /metrics, the caller's mounts, /dashboard, forwarding) and serving it
forward.py: the request path: pick a replica, forward, retry elsewhere before the first chunk
policies.py: routing policies: prefix_aware, least_load, round_robin
index.py: where prompt prefixes are likely cached
pool.py: replica health and load
metrics.py: the router's /metrics (`tokenmill:router_*`)
disagg.py: disaggregated prefill/decode routing
dashboard.py: the router's view on /dashboard
"""
