"""Teams sharing one deployment: the tenants file (keys, roots, bounds) and fair share between teams."""
