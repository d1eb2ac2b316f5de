import os
import sys

# tests import their shared references (mix_reference.py, ...) as top-level modules
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# the package is built in place at the repository root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
