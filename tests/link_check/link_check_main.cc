// The smallest program linked against one module library alone (see
// cmake/RolloutcoreLinkCheck.cmake): its DT_NEEDED entries are what that library puts on the
// link line of every binary that uses it.
int main() { return 0; }
