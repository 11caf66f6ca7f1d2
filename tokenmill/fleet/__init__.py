"""Fleet: the replicas a router runs itself, and the commands that run a router with them.

router_command.py: `tokenmill router`: its flags, replica groups, the fleets it launches, running it all
fleet.py: the fleet of launched replicas: healing, sizing, draining, rolling upgrades
autoscale.py: the autoscaler's policy: how many replicas
launchers.py: start and stop `tokenmill serve` replicas (local processes, Ray actors)
groups.py: weighted replica groups (`--group`), canaries
admin.py: the router's /admin/* endpoints and `tokenmill upgrade`
data_parallel.py: `tokenmill serve --data-parallel-size N` and `--disaggregate xPyD`: replicas plus the router
serve_command.py: `tokenmill serve`'s arguments in one place
"""
