"""Measurement tools: rollout/trainer mismatch, quality rule, screening, reports."""
