import os

# Same fair conditions as `autohc bench`: no library's idle threads spin on the cores while
# another one is timed (set before torch / numpy load their thread pools).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
