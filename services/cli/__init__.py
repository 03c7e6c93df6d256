"""The ``vmquota`` command line: the dispatcher (``main``) and the operator commands (``render``, ``usage``,
``status``, ``tail``, ``explain``, ``replay``, and their bus reader ``opsbus``). ``vmquota run`` is the platform's
runner; ``up``, ``simulate`` and ``demo`` are development tools, loaded only when chosen.
"""
