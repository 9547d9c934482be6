"""jopd.run"""
