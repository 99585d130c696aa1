"""The scheduler: cluster membership, barriers and the shared parameter layout (soft state)."""
