"""A finished run as a Hugging Face model: its checkpoint and config read back (main.py: attnres-export,
and the in-memory model attnres-tasks evaluates), its OUT_DIR guarded (folder.py)."""
