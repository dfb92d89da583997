"""Models zerohop can build by itself (no download)."""
