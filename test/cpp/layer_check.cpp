// Linked with one layer's whole static library and the layers under it
// (CMakeLists.txt): it builds only if the layer needs nothing from above.
int main() { return 0; }
