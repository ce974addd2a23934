"""Input pipelines, tokenisation and the bundled demo data."""
