"""Example pipelines, each a ``Pipeline`` named ``pipeline`` that ``--pipeline`` can name."""
