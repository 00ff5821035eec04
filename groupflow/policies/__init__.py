"""The roles that learn: ``LLMPolicy`` and ``DiffusionPolicy``, seen by the driver as a ``Policy``
and by workflows as a ``PolicyView`` (``base.py``). Nothing is re-exported here: importing this
package does not import torch-heavy modules."""
