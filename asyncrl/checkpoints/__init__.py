"""Checkpoints: where they are written and checked (docs/checkpointing.md).

- :mod:`.saving`: when and how the run saves itself (:class:`~.saving.Checkpointer`) and
  takes a checkpoint over (:class:`~.saving.Resume`), with Hugging Face exports;
- :mod:`.directory`: a checkpoint on disk: its layout, the atomic commit, retention, and the
  checks before a resume reads it;
- :mod:`.checksums`: each file's checksum, sealed when a save commits and verified before
  anything is read back;
- :mod:`.resume_rule`: which settings may change across a resume, and why.
"""
