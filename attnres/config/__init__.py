"""Checking and composing a command: its shape, each job's composed config, the value rules,
errors that are the user's to fix, and run-folder names. Imports neither training nor sweep."""
