"""The directory that ``python -m yrdask.ray`` puts first on ``PYTHONPATH`` for the Python
processes its program starts (``subprocess.run([sys.executable, "driver.py"])``): its
``ray`` package makes their ``import ray`` give yrdask.ray, as the program's own does."""
