"""Not a distribution: these `__init__.py` files make the integrations' test folders the packages
`integrations.langchain.tests` and `integrations.llamaindex.tests`, so their conftest modules clash
neither with each other nor with tests/conftest.py in one pytest run. No wheel ships them."""
