"""What an operator sees of kvhandoff: Prometheus metrics (:mod:`.metrics`) and
per-request traces (:mod:`.trace`), both fed from each request's timeline."""
