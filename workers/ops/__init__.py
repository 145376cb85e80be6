"""What operators use: the ``agentpool`` command (``cli``), the dashboard, the Prometheus exporter, the
offline demo and the benchmark."""
