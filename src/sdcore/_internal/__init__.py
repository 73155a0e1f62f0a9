"""Helpers shared by several sdcore packages; private to sdcore (no compatibility promise).

The bottom layer: it imports no other sdcore package, and every package may import it. A
package never imports another package's private ``_module`` — what two packages share lives here.
"""
