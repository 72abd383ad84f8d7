"""What several test modules share: models, batches, plans and processes, each in a module named for
what it holds. A test module imports its helpers from here (or its directory's helpers.py /
*_cases.py), never from another test module (tests/test_house.py checks)."""
