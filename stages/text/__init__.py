"""Text: corpora and packing (data), generation-quality metrics on text (text_metrics)."""
