"""The start-up audit: what a model may train under sequence parallelism. The config rules (``model_audit.py``), the
deny-by-default module rules (``sequence_rules.py``), PEFT adapters (``peft_rules.py``) and the self-check that
compares one short sequence with and without sequence parallelism (``self_check.py``). Each refusal is a
``RefusedModel`` raised before training, the same on every rank. Design: docs/design/audit.md."""
from .model_audit import ModelAudit, RefusedModel, audit_model

__all__ = ["ModelAudit", "RefusedModel", "audit_model"]
