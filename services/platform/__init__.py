"""What every service stands on: configuration and the process (``runner``), the bus client (``bus``), the
Kubernetes client (``kube``), leader election (``lease``), logging (``logs``) and reading input files (``inputs``).

The platform knows no service: the watcher, the ledger and the enforcer import it, never each other.
"""
