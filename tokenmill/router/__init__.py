"""Router and data parallel: one OpenAI-compatible front over several `tokenmill serve` replicas.

index.py (where prompt prefixes are likely cached), policies.py (prefix_aware, least_load, round_robin),
pool.py (replica health and load), forward.py (route, forward, retry), metrics.py (/metrics),
app.py (`tokenmill router`), data_parallel.py (`tokenmill serve --data-parallel-size N`); the fleet of replicas the
router runs itself: launchers.py (local processes, Ray actors), fleet.py (healing, sizing, draining, rolling
upgrades), autoscale.py (how many), groups.py (weighted replica groups, canaries), admin.py (/admin/*).
"""
