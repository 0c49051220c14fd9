"""Test kits shipped with asyncrl for plugin authors.

- :mod:`asyncrl.testing.training`: the training-backend contract suite (torch, pytest).
"""
