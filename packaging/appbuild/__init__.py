"""Build helpers for the packaged app, imported by `packaging/understudy.spec` and `build.py`.

Each module does one step of turning the checkout into `Understudy.app` (macOS) or
`dist/Understudy/` (Linux) and is a plain function over paths, so it can be tested here
against a fake wheel or bundle layout even where the step itself only runs on a Mac.
The package is not named after `packaging/` because that name belongs to pypa's
`packaging` library, which PyInstaller imports.
"""
