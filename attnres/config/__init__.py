"""Checking and composing a command: its shape, each job's composed config, the value rules,
errors that are the user's to fix, run-folder names, moved names. Imports no other runner part."""
