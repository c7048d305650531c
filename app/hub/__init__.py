"""The model manager's core: hub search and downloads, the local library, the catalog, the token
store. Plain Python with no Qt (tests/app/test_layering.py keeps it so): the GUI runs these
calls in executor threads and `understudy models` calls them directly."""
