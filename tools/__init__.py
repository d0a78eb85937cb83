"""Development tools that are not part of the package: the generated parts of the manual (``tools.docs``)."""
