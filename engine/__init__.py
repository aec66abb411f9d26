"""The engine core: requests and sampling params (``request``), config dataclasses (``config``), step
records (``records``), the scheduler (admission, KV blocks, preemption), the step loop (``engine``),
the parts it is built from (``components``), step counters (``stats``), the step timer
(``step_timer``), machine settings from ``SPECSCHED_*`` (``settings``) and the decision log's schema
and reader (``log_schema``).

``request``, ``config``, ``records`` and ``settings`` import nothing of the project, so every layer
(kernels, models, proposers, scorers, policies) may use them. This package imports no module of its
own on import, so ``from specsched.engine.request import Request`` loads the request types alone.
"""
