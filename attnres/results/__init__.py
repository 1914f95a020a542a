"""Reading results: sweep summaries and their verdicts, the scaling fit, and the figures
(dashboards, probes, sweeps). Imports nothing of config, training or sweep."""
