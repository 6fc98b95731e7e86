build/obj/daemon/policy/policy.o: daemon/policy/policy.c \
 daemon/policy/policy.h
daemon/policy/policy.h:
