"""`m2po inspect`: what a run's importance ratios look like and what each rule does to them."""
