"""Development tools: the simulated KubeVirt cluster (``simcluster``), the demo (``demo``), the embedded nats-server
(``natsserver``) and the commands built on them (``vmquota up``, ``vmquota simulate``, ``vmquota demo``).

The product never imports this package: the services, the platform and the operator commands work without it, and
the production image leaves it out (see the Dockerfile's ``product`` and ``devtools`` targets).
"""
