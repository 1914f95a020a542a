"""Reading results: sweep summaries and their verdicts, the scaling fit, and the figures
(dashboards, probes, sweeps). Of the runner it imports only `attnres.config`."""
