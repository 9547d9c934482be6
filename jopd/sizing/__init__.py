"""jopd.sizing"""
