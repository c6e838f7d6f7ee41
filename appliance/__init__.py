"""appliance: a handful of bare-metal GPU boxes as one LLM endpoint."""

__version__ = "0.1.0"
