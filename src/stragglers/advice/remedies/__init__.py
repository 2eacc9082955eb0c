"""One module per family of remedies; each class registers itself in stragglers.protocols.REMEDIES."""
