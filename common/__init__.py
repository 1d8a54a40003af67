"""Small shared helpers for the stages: launch, timing, models/data, results.

Only what two or more stages need lives here, and nothing here imports a stage. A stage's
algorithm never imports ``common`` at module top level (it must stay copyable on its own);
only its demo/benchmark harness does.
"""
